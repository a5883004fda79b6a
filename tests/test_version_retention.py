"""Model-version retention: over hundreds of versions only the newest K keep their weights (and any a
live proxy serves); Redis memory stays flat; a follower asked for a deleted version moves on."""

from __future__ import annotations

import time

import pytest
import torch

from fulmen.errors import NotFound
from fulmen.records import ProxyEndpoint, ResourcesUpdate
from fulmen.store import RedisStore
from fulmen.versions.model_version import fetch_model_version, publish_model_version
from fulmen.versions.retention import retain_versions, stored_versions

KEEP = 3
VERSIONS = 300
MEMORY_BOUND_BYTES = 1 << 20  # growth allowed from version 10 to 300: the resources log's entries


def _state(i: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((128, 128), float(i))}  # 64 KB of weights per version


async def test_three_hundred_versions_keep_redis_flat_and_never_delete_a_served_one(real_store: RedisStore) -> None:
    await real_store.registry.register_proxy(ProxyEndpoint("slow-proxy", "http://127.0.0.1:1", "m", "v5", time.time()))
    used_at_10 = 0
    for i in range(1, VERSIONS + 1):
        await publish_model_version(real_store, _state(i), model="m")
        await retain_versions(real_store, KEEP)
        if i == 10:
            used_at_10 = int((await real_store.redis.info("memory"))["used_memory"])
    used_at_300 = int((await real_store.redis.info("memory"))["used_memory"])
    assert await stored_versions(real_store) == ["v5", "v298", "v299", "v300"]
    assert used_at_300 - used_at_10 < MEMORY_BOUND_BYTES, (used_at_10, used_at_300)
    assert not await real_store.redis.exists(real_store.keys.weights("v6"))
    with pytest.raises(NotFound):
        await fetch_model_version(real_store, "v6")
    assert torch.equal((await fetch_model_version(real_store, "v5"))["w"], _state(5)["w"])  # still served
    assert torch.equal((await fetch_model_version(real_store, "v300"))["w"], _state(300)["w"])
    await real_store.registry.unregister_proxy("slow-proxy")
    assert await retain_versions(real_store, KEEP) == ["v5"]  # served no more: it goes too
    with pytest.raises(ValueError, match="at least 1"):
        await retain_versions(real_store, 0)


async def test_a_follower_skips_a_version_whose_weights_are_gone(real_store: RedisStore) -> None:
    from fulmen_llm_proxy.following import ModelFollower

    class Backend:
        def __init__(self) -> None:
            self.model_version = "base"
            self.loads: list[str] = []

        async def load_weights(self, state_dict, model_version, weights_format=None) -> bool:  # type: ignore[no-untyped-def]
            self.loads.append(model_version)
            self.model_version = model_version
            return True

    for i in range(1, 6):
        await publish_model_version(real_store, _state(i), model="m")
    await retain_versions(real_store, 2)
    outcomes: list[tuple[str, str]] = []
    follower = ModelFollower(real_store, Backend(), lambda v, outcome: outcomes.append((v, outcome)))  # type: ignore[arg-type]
    updates: list[ResourcesUpdate] = await real_store.resources.query_resources()
    for update in updates:  # a proxy that replays every announcement, old ones included
        await follower.consider(update)
    assert follower.backend.loads == ["v4", "v5"]  # type: ignore[attr-defined]
    assert outcomes == [("v4", "loaded"), ("v5", "loaded")]  # the deleted ones are no failure
