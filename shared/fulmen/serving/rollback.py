"""`fulmen rollback VERSION`: serve an older model version again.

One more resources version naming the older version's weights; every backend follows it as it
follows the trainer. Weights that Redis lost are rebuilt first from the trainer's checkpoint
(`fulmen.versions.rebuild`), the trainer stopped or not. More: docs/design/model-versions.md.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fulmen.errors import InvalidInput, NotFound
from fulmen.records import ResourcesUpdate
from fulmen.store import RedisStore
from fulmen.versions.model_version import POLICY_RESOURCES_ID, ModelVersion, llm_resource
from fulmen.versions.rebuild import Rebuilt, rebuild_version, weights_lost
from fulmen.versions.retention import stored_versions


async def rollback(store: RedisStore, version: str, resources_id: str = POLICY_RESOURCES_ID,
                   checkpoint_dir: Path | None = None) -> ResourcesUpdate:
    """Make ``version`` the served one (see the module docstring); InvalidInput says why it cannot.
    Its weights, if Redis lost them, are rebuilt first from the checkpoints in ``checkpoint_dir``."""
    try:
        current = await store.resources.get_resources(resources_id)
    except NotFound:
        raise InvalidInput(f"nothing was published to {resources_id!r} yet: there is no version to go back to") from None
    llm = llm_resource(current) or {}
    serving = ModelVersion.parse(llm.get("model_version"))
    if serving.name == version:
        raise InvalidInput(f"{version} is the version {resources_id!r} serves already")
    weights = await stored_weights(store, version, resources_id)
    await restore(store, version, checkpoint_dir)
    newest = max(serving.number, ModelVersion.parse(llm.get("newest_version")).number)
    entry = {**llm, "model_version": version, "weights": weights, "newest_version": ModelVersion.numbered(newest).name,
             "rollback": {"from": serving.name, "to": version, "at": time.time()}}
    return await store.resources.update_resources(resources_id, {**current.resources, "llm": entry},
                                        {"rollback": f"{serving.name} -> {version}"})


async def stored_weights(store: RedisStore, version: str, resources_id: str = POLICY_RESOURCES_ID) -> dict[str, Any]:
    """The ``weights`` entry that published ``version``; InvalidInput when it never was or its
    weights are no longer stored."""
    weights = None
    for update in await store.resources.query_resources(descending=True):
        llm = llm_resource(update) or {}
        if update.resources_id != resources_id:
            continue
        if llm.get("model_version") == version and isinstance(llm.get("weights"), dict) and "rollback" not in llm:
            weights = llm["weights"]
            break
    stored = await stored_versions(store)
    if weights is None:
        raise InvalidInput(f"{version} was never published to {resources_id!r}; stored versions: {_list(stored)}")
    if version not in stored:
        raise InvalidInput(f"the weights of {version} were deleted (only the newest keep_versions stay stored); "
                           f"stored versions: {_list(stored)}")
    return weights


async def restore_served(store: RedisStore, version: str, checkpoint_dir: Path | None,
                         resources_id: str = POLICY_RESOURCES_ID) -> Rebuilt | None:
    """When ``version`` is the one served already: its weights whole again (`restore`); else None
    (a rollback to it is what is asked)."""
    try:
        current = await store.resources.get_resources(resources_id)
    except NotFound:
        return None
    if (llm_resource(current) or {}).get("model_version") != version:
        return None
    return await restore(store, version, checkpoint_dir)


async def restore(store: RedisStore, version: str, checkpoint_dir: Path | None) -> Rebuilt:
    """``version``'s weights whole in the store: as they are, or rebuilt from the trainer's checkpoint
    in ``checkpoint_dir`` when Redis lost them (RebuildRefused says why they cannot be)."""
    if await weights_lost(store, version) is None:
        return Rebuilt(version, None)
    if checkpoint_dir is None:
        raise InvalidInput(f"the weights of {version} are gone from Redis (it restarted since they were written): "
                           "name the trainer's --checkpoint-dir to rebuild them")
    return await rebuild_version(store, version, checkpoint_dir, by="fulmen rollback")


def _list(versions: list[str]) -> str:
    if not versions:
        return "none"
    return ", ".join(versions) if len(versions) <= 8 else f"{', '.join(versions[:3])} … {', '.join(versions[-3:])}"
