"""The chunks of a model version come on a connection of the reader's own, straight into the blob
(`fulmen.versions.transport.socket`): the same bytes and checks as through redis-py, logged in and on the
database the client uses, and redis-py where that connection cannot be made the same way. A stream
whose chunks declare more than is there costs the reader what is there, no more."""

from __future__ import annotations

import asyncio
import logging
import mmap
import struct
import threading
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

from fulmen.errors import RecordError
from fulmen.records import WeightsChunk
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.versions.blobs import DATA_FIELD
from fulmen.versions.model_version import publish_model_version
from fulmen.versions.transport import stream as version_stream
from fulmen.versions.transport.redis import RedisTransport
from fulmen.versions.transport.socket import ChunkSocket
from fulmen.versions.transport.stream import read_stream


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 32, generator=g).to(torch.bfloat16), "w": torch.randn(48, 40, generator=g)}


@pytest.fixture
def xranges(real_store: RedisStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each XRANGE a read sends: ``"client"`` through redis-py, ``"own"`` on the reader's own connection."""
    calls: list[str] = []
    real_send, real_xrange = ChunkSocket.send, real_store.weights_redis.xrange

    def send(self: ChunkSocket, *args: str | int | bytes) -> None:
        if args[0] == "XRANGE":
            calls.append("own")
        real_send(self, *args)

    async def xrange(*args: object, **kwargs: object) -> object:
        calls.append("client")
        return await real_xrange(*args, **kwargs)

    monkeypatch.setattr(ChunkSocket, "send", send)
    monkeypatch.setattr(real_store.weights_redis, "xrange", xrange)
    return calls


async def _write_chunks(
    store: RedisStore, version: str, total: int, size: int, pieces: list[bytes], sha256: str = "ab" * 32
) -> None:
    """A weights stream written by hand: ``pieces`` as its first chunks, each declaring ``total`` and ``size``."""
    for index, data in enumerate(pieces):
        head = WeightsChunk(version, index, total, sha256, size, b"").to_wire()
        await store.weights_redis.xadd(store.keys.weights(version), {"m": head, DATA_FIELD: data}, id=f"0-{index + 1}")


@pytest.mark.parametrize("follow_s", [None, 0.5], ids=["fetch", "prefetch"])
@pytest.mark.parametrize("total", [10**12, 2**63 - 1])
async def test_a_first_chunk_declaring_more_chunks_than_its_size_allows_is_refused_at_once(
    real_store: RedisStore, xranges: list[str], total: int, follow_s: float | None
) -> None:
    """A version's one chunk rewritten to declare a huge number of chunks (its size and bytes kept) is
    refused before anything is allocated or any further page asked for, as a fetch and as a prefetch."""
    await publish_model_version(real_store, _weights(8), model="m", model_version="v1",
                                transport=RedisTransport(chunk_bytes=1_000_000))
    key = real_store.keys.weights("v1")
    [(_, fields)] = await real_store.redis.xrange(key)
    chunk = WeightsChunk.from_wire(fields[b"m"])
    await real_store.redis.delete(key)
    await _write_chunks(real_store, "v1", total, chunk.size, [fields[DATA_FIELD.encode()]], chunk.sha256)
    xranges.clear()
    with pytest.raises(RecordError, match=rf"model version v1: .* declares {total:,} chunks .* cannot be true"):
        await read_stream(real_store, "v1", follow_s=follow_s)
    assert xranges == ([] if follow_s else ["client"])  # a follow reads its first chunk with XREAD


@pytest.mark.parametrize("own", [True, False], ids=["own connection", "redis-py"])
async def test_a_total_larger_than_the_chunks_there_costs_only_the_pages_they_fill(
    real_store: RedisStore, xranges: list[str], monkeypatch: pytest.MonkeyPatch, own: bool
) -> None:
    """Five chunks whose first declares 100,000 of them (a size to match): the read stops with
    RecordError at the first page that comes back short, its XRANGEs bounded by the chunks there."""
    monkeypatch.setattr(version_stream, "READ_PAGE_BYTES", 200)  # pages of 2 chunks of 100 bytes
    if not own:
        monkeypatch.setattr(ChunkSocket, "open", classmethod(lambda cls, client: None))
    header = struct.pack("<Q", 1_000_000).ljust(100, b" ")  # a safetensors header longer than what comes
    await _write_chunks(real_store, "v1", 100_000, 10_000_000, [header] + [bytes([i]) * 100 for i in range(1, 5)])
    with pytest.raises(RecordError, match=r"model version v1 is incomplete: 5 of 100,000 chunks .* found 0"):
        await read_stream(real_store, "v1")
    # the first chunk, two full pages, the empty one, and at most PAGES_AHEAD asked ahead of it
    assert 4 <= len(xranges) <= 4 + version_stream.PAGES_AHEAD
    assert set(xranges[1:]) == {"own" if own else "client"}


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each read got its own connection (True) or kept redis-py (False)."""
    calls: list[bool] = []
    real = ChunkSocket.open.__func__  # type: ignore[attr-defined]

    def spy(cls: type[ChunkSocket], client: object) -> ChunkSocket | None:
        reader = real(cls, client)
        calls.append(reader is not None)
        return reader

    monkeypatch.setattr(ChunkSocket, "open", classmethod(spy))
    return calls


async def test_the_own_connection_reads_what_redis_py_reads(
    real_store: RedisStore, opened: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    await publish_model_version(real_store, _weights(1), model="m", model_version="v1", transport=RedisTransport(chunk_bytes=1000))
    mine = await read_stream(real_store, "v1")
    monkeypatch.setattr(ChunkSocket, "open", classmethod(lambda cls, client: None))
    theirs = await read_stream(real_store, "v1")
    assert opened == [True] and mine is not None and theirs is not None
    assert bytes(mine[0]) == bytes(theirs[0]) and mine[1:] == theirs[1:] == (mine[1], "manifest")


async def test_a_corrupt_or_missing_chunk_is_refused_on_the_own_connection(
    real_store: RedisStore, opened: list[bool]
) -> None:
    await publish_model_version(real_store, _weights(2), model="m", model_version="v2", transport=RedisTransport(chunk_bytes=1000))
    key = real_store.keys.weights("v2")
    entries = await real_store.redis.xrange(key)

    async def rewrite(keep: list[tuple[bytes, dict]]) -> None:
        await real_store.redis.delete(key)
        for entry_id, fields in keep:
            await real_store.redis.xadd(key, fields, id=entry_id.decode())

    await rewrite(entries[:5] + entries[6:])
    with pytest.raises(RecordError, match="missing or foreign"):
        await read_stream(real_store, "v2")
    broken = {b"m": entries[5][1][b"m"], b"d": b"x" * len(entries[5][1][b"d"])}
    await rewrite([*entries[:5], (entries[5][0], broken), *entries[6:]])
    with pytest.raises(RecordError, match="corrupt"):
        await read_stream(real_store, "v2")
    assert opened == [True, True]


async def test_it_logs_in_and_selects_the_clients_database(tmp_path: Path, opened: list[bool]) -> None:
    with EmbeddedRedis(tmp_path / "redis", port=None) as server:
        admin = aioredis.Redis(port=server.port)
        await admin.config_set("requirepass", "s3cret")
        client = aioredis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/3")
        store = RedisStore(client, "auth")
        await publish_model_version(store, _weights(3), model="m", model_version="v1", transport=RedisTransport(chunk_bytes=1000))
        found = await read_stream(store, "v1")
        assert opened == [True] and found is not None and found[2] == "manifest"
        wrong = aioredis.Redis.from_url(f"redis://:nope@127.0.0.1:{server.port}/3")
        assert ChunkSocket.open(wrong) is None  # refused: the reader keeps redis-py (which says why)
        await client.aclose()
        await wrong.aclose()


async def test_what_it_cannot_connect_like_the_client_it_leaves_to_redis_py(
    redis_server: EmbeddedRedis, redis_cluster: object, opened: list[bool]
) -> None:
    from fulmen.store.redis.connection import async_client

    port = redis_server.port
    plain = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
    tls = aioredis.Redis.from_url(f"rediss://127.0.0.1:{port}/0")
    resp3 = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0", protocol=3)
    nobody = aioredis.Redis.from_url("redis://127.0.0.1:1/0")  # nothing listens on port 1
    own = ChunkSocket.open(plain)
    assert own is not None and [ChunkSocket.open(c) for c in (tls, resp3, nobody)] == [None, None, None]
    own.close()
    cluster = async_client(redis_cluster.url)  # type: ignore[attr-defined]
    await cluster.ping()
    store = RedisStore(cluster, "cluster-weights")
    await publish_model_version(store, _weights(4), model="m", model_version="v1", transport=RedisTransport(chunk_bytes=1000))
    found = await read_stream(store, "v1")
    assert found is not None and found[2] == "manifest" and opened[-1] is False
    await cluster.aclose()


async def test_pages_in_flight_and_a_dropped_connection_lose_nothing(
    real_store: RedisStore, opened: list[bool], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Chunks larger than a recv, two pages asked ahead; the connection dropped in the middle of a
    chunk: the read goes on through redis-py from the last whole chunk, and the bytes are the same."""
    monkeypatch.setattr(version_stream, "READ_PAGE_BYTES", 300_000)  # pages of 2 chunks
    weights = {"w": torch.randn(400, 1000, generator=torch.Generator().manual_seed(5))}  # 1.6 MB
    await publish_model_version(real_store, weights, model="m", model_version="v1", transport=RedisTransport(chunk_bytes=150_000))
    whole = await read_stream(real_store, "v1")
    real_into, calls = ChunkSocket._into, []

    def dropping(self: ChunkSocket, target: memoryview) -> None:
        calls.append(len(target))
        if len(calls) == 4:
            self.sock.recv_into(target[:1000])  # part of the chunk in, then the connection goes
            raise ConnectionResetError("dropped")
        real_into(self, target)

    monkeypatch.setattr(ChunkSocket, "_into", dropping)
    with caplog.at_level(logging.WARNING):
        again = await read_stream(real_store, "v1")
    assert whole is not None and again is not None and bytes(again[0]) == bytes(whole[0])
    assert again[2] == "manifest" and opened == [True, True] and len(calls) == 4
    assert "going on with the client's" in caplog.text


async def test_a_cancelled_read_leaves_the_buffer_free(
    real_store: RedisStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Cancelled while its thread receives a chunk, the read ends that thread before it returns: the
    caller's memory map closes (no view of it is left) and nothing writes into it afterwards."""
    await publish_model_version(real_store, _weights(6), model="m", model_version="v1", transport=RedisTransport(chunk_bytes=1000))
    real_into, receiving = ChunkSocket._into, threading.Event()

    def slow(self: ChunkSocket, target: memoryview) -> None:
        receiving.set()
        time.sleep(0.3)
        real_into(self, target)

    monkeypatch.setattr(ChunkSocket, "_into", slow)
    maps: list[mmap.mmap] = []

    def allocate(size: int) -> mmap.mmap:
        maps.append(mmap.mmap(-1, size))
        return maps[-1]

    reading = asyncio.ensure_future(read_stream(real_store, "v1", allocate))
    while not receiving.is_set():
        await asyncio.sleep(0.01)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    before = bytes(maps[0])
    maps[0].close()  # BufferError if a view were left
    assert before.count(0) < len(before)  # the first chunks did land


async def test_an_acl_user_logs_in(tmp_path: Path, opened: list[bool]) -> None:
    with EmbeddedRedis(tmp_path / "redis", port=None) as server:
        admin = aioredis.Redis(port=server.port)
        await admin.execute_command("ACL", "SETUSER", "trainer", "on", ">pw", "~*", "+@all")
        client = aioredis.Redis.from_url(f"redis://trainer:pw@127.0.0.1:{server.port}/0")
        store = RedisStore(client, "acl")
        await publish_model_version(store, _weights(7), model="m", model_version="v1", transport=RedisTransport(chunk_bytes=1000))
        found = await read_stream(store, "v1")
        assert opened == [True] and found is not None and found[2] == "manifest"
        await client.aclose()
        await admin.aclose()
