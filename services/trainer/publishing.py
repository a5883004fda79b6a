"""How the trainer publishes its weights: whole, or as a delta against the version before; and again
when Redis lost a version's chunks: under its own name from its checkpoint (`fulmen.versions.rebuild`),
for the newest version and for any a proxy asks for, else the newest as the next version.

``publish_format`` full or delta (keyframes every ``keyframe_every``), see `fulmen.versions.delta`.
Lost weights are looked for at start and every `CHECK_EVERY_S`; why, and when not: docs/design/trainer.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from fulmen.settings import TrainerSettings
from fulmen.store import RedisStore
from fulmen.versions.delta import encode_delta
from fulmen.versions.manifest import DELTA, Manifest, describe_all
from fulmen.versions.model_version import (
    PublishOptions,
    llm_resource,
    next_model_version,
    publish_model_version,
    transport_for,
)
from fulmen.versions.rebuild import RebuildRefused, rebuild_version
from fulmen.versions.rebuild_asks import answer_asks

log = logging.getLogger(__name__)

CHECK_EVERY_S = 10.0  # one XLEN per check


class VersionPublisher:
    def __init__(self, settings: TrainerSettings, lora: bool) -> None:
        self.s = settings
        self.delta = settings.publish_format == "delta" and not lora
        self.previous: tuple[str, dict[str, torch.Tensor]] | None = None
        self.since_keyframe = 0

    async def publish(self, store: RedisStore, state: Mapping[str, torch.Tensor], *, model: str, version: str,
                      weights_format: Mapping[str, Any] | None, replace_unpublished: bool, exact: bool) -> None:
        # on the host once: hashing, the delta and the blob would each copy a GPU tensor again
        state = await asyncio.to_thread(_on_host, state)
        delta_on = self.previous if self.delta and not exact and self.since_keyframe + 1 < self.s.keyframe_every else None
        if delta_on is None:
            await publish_model_version(store, state, model=model, model_version=version,
                                        transport=transport_for(self.s.weights_dir), weights_format=weights_format,
                                        options=PublishOptions(replace_unpublished=replace_unpublished))
            self.since_keyframe = 0
        else:
            base, previous = delta_on
            delta = await asyncio.to_thread(encode_delta, previous, state)
            manifest = Manifest(DELTA, base, await asyncio.to_thread(describe_all, state))
            await publish_model_version(store, delta, model=model, model_version=version,
                                        transport=transport_for(self.s.weights_dir), manifest=manifest,
                                        options=PublishOptions(replace_unpublished=replace_unpublished),
                                        weights_format={"format": DELTA, "base_version": base})
            self.since_keyframe += 1
        if self.delta:
            # a copy: the published tensors may be the live parameters, which the next step changes
            self.previous = (version, {n: t.detach().to("cpu", copy=True) for n, t in state.items()}) if not exact else None


def _on_host(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state's tensors on the CPU (those already there as they are, not copied)."""
    return {name: tensor.detach().to("cpu") for name, tensor in state.items()}


# --- lost weights: Redis restarted and the newest version's chunks are gone -----------------------------


class LostWeightsWatch:
    """When the trainer last looked, and the announcement of the version it looked for."""

    def __init__(self) -> None:
        self.next_check = 0.0
        self.version: str | None = None
        self.announced: dict[str, Any] | None = None  # the newest "llm" entry naming any version
        self.reported: str | None = None  # the version a sharded trainer said it cannot publish again

    async def announcement(self, trainer: Any, *, fresh: bool = False) -> dict[str, Any] | None:
        """The newest resources entry that names a model version (read once per trainer version, or
        again if ``fresh``)."""
        if fresh or self.version != trainer.version.name:
            self.version, self.announced = trainer.version.name, None
            latest = await trainer.store.resources.get_latest_resources()  # the newest entry; the whole log only
            updates = [latest] if latest is not None else []  # when it names no version (validation's)
            if latest is not None and not (llm_resource(latest) or {}).get("model_version"):
                updates = await trainer.store.resources.query_resources(descending=True)
            for update in updates:
                llm = llm_resource(update)
                if llm is not None and llm.get("model_version"):
                    self.announced = llm
                    break
        return self.announced


async def weights_lost(trainer: Any, watch: LostWeightsWatch) -> bool:
    """Whether the trainer's newest version, still the one the resources announce last and in force (no
    rollback, no A/B test), has fewer chunks stored than it was published with. The shared folder
    (``weights_dir``) is not Redis's to lose; version 0 is the base model, never published."""
    if trainer.version.number == 0 or trainer.s.weights_dir is not None:
        return False
    store = trainer.store
    stored = await store.weights_redis.xlen(store.keys.weights(trainer.version.name))
    llm = await watch.announcement(trainer)
    if llm is None or llm.get("model_version") != trainer.version.name:
        return False
    weights = llm.get("weights")
    chunks = weights.get("chunks") if isinstance(weights, dict) else None
    if not isinstance(chunks, int) or stored >= chunks:
        return False
    llm = await watch.announcement(trainer, fresh=True)  # an operator may have rolled back since
    return llm is not None and llm.get("model_version") == trainer.version.name and not ("rollback" in llm or "ab" in llm)


async def republish_if_lost(trainer: Any, *, now: bool = False) -> bool:
    """On the leader, at most every CHECK_EVERY_S (``now``: this time whatever the last check): if Redis
    lost the newest version's weights, write them again under its own name from its checkpoint, or
    publish the weights again as the next version when no checkpoint holds its bytes (the module
    docstring says why). True if it did either."""
    watch = trainer.lost_weights
    clock = time.monotonic()
    if not trainer.leads or (not now and clock < watch.next_check):
        return False
    watch.next_check = clock + CHECK_EVERY_S
    if not await weights_lost(trainer, watch):
        return False
    lost = trainer.version.name
    try:
        await rebuild_version(trainer.store, lost, trainer.checkpoint_folder, by=trainer.consumer)
        return True  # the same bytes under the same name: the delta base and every span stay right
    except RebuildRefused as e:
        log.warning("the weights of model version %s are gone from Redis and cannot be rebuilt: %s", lost, e)
    if getattr(trainer.ranks, "sharded", False):
        if watch.reported != lost:
            watch.reported = lost
            log.error("the weights of model version %s are gone from Redis (it restarted since they were written): "
                      "proxies that start now serve their base weights until the next step's version", lost)
        return False
    trainer.publisher.previous = None  # whole: the version a delta would build on is gone too
    trainer.version = await next_model_version(trainer.store, shared_dir=trainer.s.weights_dir)
    log.warning("the weights of model version %s are gone from Redis (it restarted since they were written): "
                "publishing the trainer's weights again as %s", lost, trainer.version.name)
    await trainer.checkpoint()  # a restart resumes under the new name
    await trainer.publish()
    return True


async def answer_rebuild_asks(trainer: Any) -> int:
    """On the leader: rebuild from this trainer's checkpoints the lost versions proxies and vllm-syncs asked
    for (`fulmen.versions.rebuild_asks`), answering each; the number answered."""
    if not trainer.leads:
        return 0
    folder = trainer.checkpoint_folder
    return await answer_asks(trainer.store, trainer.consumer,
                             lambda version: rebuild_version(trainer.store, version, folder, by=trainer.consumer))
