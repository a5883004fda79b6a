"""How the trainer publishes its weights: whole, or as a delta against the version before.

``publish_format`` full or delta (keyframes every ``keyframe_every``); see docs/design/trainer.md and
`fulmen.versions.delta`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import torch

from fulmen.settings import TrainerSettings
from fulmen.store import RedisStore
from fulmen.versions.delta import encode_delta
from fulmen.versions.manifest import DELTA, Manifest, describe_all
from fulmen.versions.model_version import publish_model_version


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
            await publish_model_version(store, state, model=model, model_version=version, shared_dir=self.s.weights_dir,
                                        replace_unpublished=replace_unpublished, weights_format=weights_format)
            self.since_keyframe = 0
        else:
            base, previous = delta_on
            delta = await asyncio.to_thread(encode_delta, previous, state)
            manifest = Manifest(DELTA, base, await asyncio.to_thread(describe_all, state))
            await publish_model_version(store, delta, model=model, model_version=version, shared_dir=self.s.weights_dir,
                                        replace_unpublished=replace_unpublished, manifest=manifest,
                                        weights_format={"format": DELTA, "base_version": base})
            self.since_keyframe += 1
        if self.delta:
            # a copy: the published tensors may be the live parameters, which the next step changes
            self.previous = (version, {n: t.detach().to("cpu", copy=True) for n, t in state.items()}) if not exact else None


def _on_host(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state's tensors on the CPU (those already there as they are, not copied)."""
    return {name: tensor.detach().to("cpu") for name, tensor in state.items()}
