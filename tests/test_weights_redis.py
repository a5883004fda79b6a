"""FULMEN_WEIGHTS_REDIS_URL (opt-in): the weight chunks live in a Redis of their own; names, resources
and retention's bookkeeping stay in the main one."""

from __future__ import annotations

from pathlib import Path

import torch

from fulmen.settings import CommonSettings
from fulmen.store import RedisStore
from fulmen.store.redis.connection import connect_weights
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.versions.model_version import fetch_model_version, next_model_version, publish_model_version
from fulmen.versions.retention import retain_versions, stored_versions
from fulmen.versions.transport.redis import RedisTransport


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(30, 8, generator=g).to(torch.bfloat16), "b.bias": torch.randn(8, generator=g)}


async def test_weights_live_in_their_own_redis(real_store: RedisStore, tmp_path: Path) -> None:
    assert real_store.weights_redis is real_store.redis  # the default: one Redis
    with EmbeddedRedis(tmp_path / "weights", port=None) as server:
        weights_client = await connect_weights(CommonSettings(weights_redis_url=server.url), wait_s=10)
        assert weights_client is not None
        await weights_client.config_set("appendonly", "no")
        store = RedisStore(real_store.redis, real_store.experiment, weights_redis=weights_client)
        try:
            first, second = _weights(0), _weights(1)
            await publish_model_version(store, first, model="m", transport=RedisTransport(chunk_bytes=300))
            key = store.keys.weights("v1")
            assert await weights_client.exists(key) and not await real_store.redis.exists(key)
            got = await fetch_model_version(store, "v1")
            assert all(got[n].view(torch.uint8).equal(first[n].view(torch.uint8)) for n in first)
            assert (await next_model_version(store)).name == "v2"
            await weights_client.xadd(store.keys.weights("v2"), {"m": b"a crashed publish"}, id="0-1")
            assert (await next_model_version(store)).name == "v3"  # a name taken in the weights Redis
            await publish_model_version(store, second, model="m")
            assert await retain_versions(store, 1) == ["v1"]
            assert not await weights_client.exists(key)
            assert await stored_versions(store) == ["v3"]
        finally:
            await weights_client.aclose()


async def test_no_weights_redis_unless_set() -> None:
    assert await connect_weights(CommonSettings()) is None
