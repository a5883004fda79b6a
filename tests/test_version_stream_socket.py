"""The chunks of a model version come on a connection of the reader's own, straight into the blob
(`fulmen.version_stream_socket`): the same bytes and checks as through redis-py, logged in and on the
database the client uses, and redis-py where that connection cannot be made the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

from fulmen.embedded import EmbeddedRedis
from fulmen.errors import RecordError
from fulmen.model_versions import publish_model_version
from fulmen.store import RedisStore
from fulmen.version_stream import read_stream
from fulmen.version_stream_socket import ChunkSocket


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 32, generator=g).to(torch.bfloat16), "w": torch.randn(48, 40, generator=g)}


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
    await publish_model_version(real_store, _weights(1), model="m", model_version="v1", chunk_bytes=1000)
    mine = await read_stream(real_store, "v1")
    monkeypatch.setattr(ChunkSocket, "open", classmethod(lambda cls, client: None))
    theirs = await read_stream(real_store, "v1")
    assert opened == [True] and mine is not None and theirs is not None
    assert bytes(mine[0]) == bytes(theirs[0]) and mine[1:] == theirs[1:] == (mine[1], "manifest")


async def test_a_corrupt_or_missing_chunk_is_refused_on_the_own_connection(
    real_store: RedisStore, opened: list[bool]
) -> None:
    await publish_model_version(real_store, _weights(2), model="m", model_version="v2", chunk_bytes=1000)
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
        await publish_model_version(store, _weights(3), model="m", model_version="v1", chunk_bytes=1000)
        found = await read_stream(store, "v1")
        assert opened == [True] and found is not None and found[2] == "manifest"
        wrong = aioredis.Redis.from_url(f"redis://:nope@127.0.0.1:{server.port}/3")
        assert ChunkSocket.open(wrong) is None  # refused: the reader keeps redis-py (which says why)
        await client.aclose()
        await wrong.aclose()


def test_what_it_cannot_connect_like_the_client_it_leaves_to_redis_py() -> None:
    tls = aioredis.Redis.from_url("rediss://127.0.0.1:1/0")
    resp3 = aioredis.Redis.from_url("redis://127.0.0.1:1/0", protocol=3)
    nobody = aioredis.Redis.from_url("redis://127.0.0.1:1/0")  # nothing listens on port 1
    assert [ChunkSocket.open(c) for c in (tls, resp3, nobody)] == [None, None, None]
