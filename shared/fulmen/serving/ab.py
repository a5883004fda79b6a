"""A/B serving: two model versions at once, rollouts split between them by a stable hash.

`fulmen ab A B --split 0.3` names B beside A in the policy's ``llm`` entry; `arm_of` picks a rollout's
arm. Torch proxies serve B from a second engine; vLLM replicas serve a LoRA B as an adapter beside A (vllm-sync
loads it, the proxy routes B's rollouts to it). A new version from the trainer ends the test. More: docs/design/model-versions.md.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from fulmen.errors import InvalidInput, NotFound
from fulmen.records import ResourcesUpdate
from fulmen.serving.rollback import stored_weights
from fulmen.store import RedisStore
from fulmen.versions.model_version import POLICY_RESOURCES_ID, llm_resource

ARMS = ("a", "b")


def arm_of(rollout_id: str, split: float) -> str:
    """"b" for a ``split`` fraction of rollout ids, "a" for the rest; the same answer everywhere."""
    if not rollout_id or split <= 0:
        return "a"
    fraction = int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:8], "big") / 2**64
    return "b" if fraction < split else "a"


def ab_of(llm: dict[str, Any] | None) -> tuple[str, dict[str, Any], float] | None:
    """(B's version, B's weights entry, split) of an ``llm`` entry in A/B mode, else None."""
    ab = (llm or {}).get("ab")
    if not isinstance(ab, dict) or not isinstance(ab.get("b"), dict):
        return None
    b, split = ab["b"], ab.get("split")
    if not isinstance(b.get("model_version"), str) or not isinstance(b.get("weights"), dict):
        return None
    if not isinstance(split, int | float) or not 0 < split < 1:
        return None
    return b["model_version"], b["weights"], float(split)


async def start_ab(store: RedisStore, a: str, b: str, split: float = 0.5,
                   resources_id: str = POLICY_RESOURCES_ID) -> ResourcesUpdate:
    if not 0 < split < 1:
        raise InvalidInput(f"split is {split}: the fraction of rollouts B serves, strictly between 0 and 1")
    if a == b:
        raise InvalidInput(f"A and B are both {a}: an A/B test needs two versions")
    current, llm = await _current(store, resources_id)
    entry = dict(llm)
    if a != llm.get("model_version"):
        entry.update(model_version=a, weights=await stored_weights(store, a, resources_id))
    entry["ab"] = {"b": {"model_version": b, "weights": await stored_weights(store, b, resources_id)},
                   "split": split, "at": time.time()}
    return await store.resources.update_resources(resources_id, {**current.resources, "llm": entry}, {"ab": f"{a} | {b} {split}"})


async def stop_ab(store: RedisStore, resources_id: str = POLICY_RESOURCES_ID) -> ResourcesUpdate:
    current, llm = await _current(store, resources_id)
    if "ab" not in llm:
        raise InvalidInput(f"{resources_id!r} is not in A/B mode")
    entry = {k: v for k, v in llm.items() if k != "ab"}
    return await store.resources.update_resources(resources_id, {**current.resources, "llm": entry}, {"ab": "off"})


async def _current(store: RedisStore, resources_id: str) -> tuple[ResourcesUpdate, dict[str, Any]]:
    try:
        current = await store.resources.get_resources(resources_id)
    except NotFound:
        raise InvalidInput(f"nothing was published to {resources_id!r} yet") from None
    return current, dict(llm_resource(current) or {})
