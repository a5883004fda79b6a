"""Redis's AOF is rewritten between model versions (`fulmen.store.redis.aof`), not in the middle of
writing one: by the usual rule (grown by 100%, big enough), and only once every live proxy serves the
newest version (a rewrite during their reads would slow them), and never while a version's weights
are being written (a publish waits for a running one); the weights themselves stay out of the AOF
(`fulmen.versions.blobs`), what names them does not. Each test has a server of its own: a rewrite
on the shared one would meet other tests' rewrites."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

from fulmen.errors import InvalidInput, NotFound, RecordError
from fulmen.records import ProxyEndpoint
from fulmen.store import RedisStore
from fulmen.store.redis import aof as aof_rewrite
from fulmen.store.redis.aof import rewrite_if_grown, wait_for_rewrite, weights_being_written, writing_weights
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.versions import blobs as version_blobs
from fulmen.versions.model_version import fetch_model_version, publish_model_version
from fulmen.versions.retention import retain_versions, rewrite_aof_between_versions, stored_versions


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[aioredis.Redis]:
    with EmbeddedRedis(tmp_path / "redis", port=None) as embedded:
        client = aioredis.from_url(embedded.url)
        # with everysec, a write to the AOF waits (up to 2 s) while the last fsync runs: the file's
        # size in INFO would lag the writes these tests count on
        await client.config_set("appendfsync", "no")
        try:
            yield client
        finally:
            await client.aclose()


async def _rewritten(client: aioredis.Redis) -> int:
    """The AOF's size after the last rewrite, once no rewrite is under way."""
    while True:
        info = await client.info("persistence")
        if not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
            return int(info["aof_base_size"])
        await asyncio.sleep(0.01)


async def test_a_rewrite_starts_when_the_file_has_doubled_and_is_big_enough(server: aioredis.Redis) -> None:
    await server.set("k", b"x" * 100_000)
    assert not await rewrite_if_grown(server, min_bytes=1 << 30)  # too small to bother
    assert await rewrite_if_grown(server, min_bytes=1)  # grown from nothing
    base = await _rewritten(server)
    assert base > 100_000
    assert not await rewrite_if_grown(server, min_bytes=1)  # not grown since
    await server.set("k2", b"y" * (base // 2))
    assert not await rewrite_if_grown(server, min_bytes=1)  # grown by half: not yet
    await server.set("k3", b"z" * base)
    assert await rewrite_if_grown(server, min_bytes=1)
    assert await _rewritten(server) > base


async def test_no_rewrite_without_aof(server: aioredis.Redis) -> None:
    await server.config_set("appendonly", "no")
    await server.set("k", b"x" * 100_000)
    assert not await rewrite_if_grown(server, min_bytes=1)


async def test_retention_rewrites_only_once_the_proxies_serve_the_newest_version(
    server: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aof_rewrite, "MIN_BYTES", 1)
    store = RedisStore(server, f"aof-{uuid.uuid4().hex[:8]}")
    await store.queue.ensure()
    proxy = ProxyEndpoint("p1", "http://127.0.0.1:1", "m", "base", time.time())
    await store.registry.register_proxy(proxy)
    for i in (1, 2):
        await publish_model_version(store, {"w": torch.full((256, 256), float(i))}, model="m")
    before = await _rewritten(server)
    # the trainer's pass, right after the publish: the proxy is still on its way to v2
    assert await retain_versions(store, 1) == ["v1"]
    assert await _rewritten(server) == before
    assert not await rewrite_aof_between_versions(store, wait_s=0.05, poll_s=0.01)
    # once it serves v2, the rewrite is due (the file grew from nothing) and starts
    waiting = asyncio.create_task(rewrite_aof_between_versions(store, wait_s=30, poll_s=0.01))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await store.registry.register_proxy(replace(proxy, model_version="v2"))
    assert await asyncio.wait_for(waiting, 30)
    assert await _rewritten(server) != before


async def test_no_rewrite_starts_while_a_version_is_being_written(server: aioredis.Redis) -> None:
    await server.set("k", b"x" * 100_000)
    async with writing_weights(server):
        assert await weights_being_written(server)
        assert not await rewrite_if_grown(server, min_bytes=1)  # due, but deferred
    assert not await weights_being_written(server)
    assert await rewrite_if_grown(server, min_bytes=1)  # the next pass starts it


async def test_a_dead_publishers_claim_lapses(server: aioredis.Redis) -> None:
    await server.set("k", b"x" * 100_000)
    seconds, _ = await server.time()
    await server.zadd(aof_rewrite.WRITES_KEY, {"killed-mid-write": seconds - 1})
    assert await rewrite_if_grown(server, min_bytes=1)
    assert await server.zcard(aof_rewrite.WRITES_KEY) == 0


async def _slow_rewrite(server: aioredis.Redis) -> None:
    """A rewrite that runs ~1 s on a tiny dataset: the server pauses 20 ms per key it rewrites."""
    await server.config_set("rdb-key-save-delay", 20_000)
    for i in range(50):
        await server.set(f"slow{i}", "x")
    await server.bgrewriteaof()
    assert (await server.info("persistence"))["aof_rewrite_in_progress"]


async def test_a_publish_waits_for_a_running_rewrite_before_its_first_chunk(
    server: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RedisStore(server, f"aof-{uuid.uuid4().hex[:8]}")
    await store.queue.ensure()
    rewriting_at_write: list[int] = []
    write_stream = version_blobs.write_stream

    async def observed(*args: object, **kwargs: object) -> dict:
        rewriting_at_write.append((await server.info("persistence"))["aof_rewrite_in_progress"])
        return await write_stream(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(version_blobs, "write_stream", observed)
    await _slow_rewrite(server)
    await publish_model_version(store, {"w": torch.ones(64, 64)}, model="m", model_version="v1")
    assert rewriting_at_write == [0]
    assert await server.zcard(aof_rewrite.WRITES_KEY) == 0  # the claim ends with the publish
    # a failed publish (the name is taken) releases its claim too
    with pytest.raises(InvalidInput):
        await publish_model_version(store, {"w": torch.ones(64, 64)}, model="m", model_version="v1")
    assert await server.zcard(aof_rewrite.WRITES_KEY) == 0


async def test_the_wait_for_a_rewrite_is_bounded(server: aioredis.Redis) -> None:
    await _slow_rewrite(server)
    assert not await wait_for_rewrite(server, wait_s=0.05, poll_s=0.01)
    assert await wait_for_rewrite(server, wait_s=30, poll_s=0.01)


async def _aof_size(client: aioredis.Redis) -> int:
    return int((await client.info("persistence"))["aof_current_size"])


@pytest.mark.parametrize("in_aof", [False, True])
async def test_weights_stay_out_of_the_aof_unless_asked(
    server: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, in_aof: bool
) -> None:
    if in_aof:
        monkeypatch.setenv(version_blobs.WEIGHTS_IN_AOF_ENV, "1")
    store = RedisStore(server, f"aof-{uuid.uuid4().hex[:8]}")
    await store.queue.ensure()
    before = await _aof_size(server)
    update = await publish_model_version(store, {"w": torch.ones(512, 1024)}, model="m", model_version="v1")
    blob_bytes = update.resources["llm"]["weights"]["bytes"]  # 2 MB
    grown = await _aof_size(server) - before
    assert grown > 0  # the resources entry and the version's bookkeeping: always in the AOF
    assert (grown >= blob_bytes) if in_aof else (grown < blob_bytes / 10)
    state = (await fetch_model_version(store, "v1"))
    assert torch.equal(state["w"], torch.ones(512, 1024))


async def test_after_a_crash_the_versions_resources_survive_and_the_next_version_loads(tmp_path: Path) -> None:
    """The weights are the trainer's to publish again: a restart loses those written since the last
    AOF rewrite, never the resources naming them, and the next version publishes and reads as usual."""
    with EmbeddedRedis(tmp_path / "redis", port=None) as embedded:
        client = aioredis.from_url(embedded.url)
        await client.config_set("appendfsync", "always")  # no second of writes lost to the kill
        store = RedisStore(client, "crash")
        await store.queue.ensure()
        await publish_model_version(store, {"w": torch.ones(64, 64)}, model="m", model_version="v1")
        await client.aclose()
        embedded.kill()
        embedded.start()
        client = aioredis.from_url(embedded.url)
        try:
            store = RedisStore(client, "crash")
            latest = await store.resources.get_latest_resources()
            assert latest is not None and latest.resources["llm"]["model_version"] == "v1"
            assert await stored_versions(store) == ["v1"]
            assert not await client.exists(store.keys.weights("v1"))
            with pytest.raises((NotFound, RecordError)):
                await fetch_model_version(store, "v1")
            await publish_model_version(store, {"w": torch.full((64, 64), 2.0)}, model="m", model_version="v2")
            assert torch.equal((await fetch_model_version(store, "v2"))["w"], torch.full((64, 64), 2.0))
        finally:
            await client.aclose()
