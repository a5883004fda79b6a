"""Hot Redis commands on a connection of their own (`fulmen.store.redis.hot_connection`), as the proxy runs them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.store.redis.hot_connection import HotConnection


@pytest.fixture
async def client(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    """A plain client of one Redis (a cluster client routes each command itself: no hot connection)."""
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_hot_commands_answer_as_the_client_does_on_one_connection(client: aioredis.Redis,
                                                                       experiment: str) -> None:
    """HMGET and EVALSHA answer as through the client (an error reply raised), all on one connection."""
    key = f"{experiment}:h"
    await client.hset(key, mapping={"a": "1", "b": "2"})
    script = client.register_script("return {KEYS[1], ARGV[1]}")
    await script(keys=[key], args=["x"])  # loaded
    hot = HotConnection.install(client)
    assert await client.hmget(key, ["a", "missing", "b"]) == [b"1", None, b"2"]
    assert await client.execute_command("EVALSHA", script.sha, 1, key, "y") == [key.encode(), b"y"]
    with pytest.raises(NoScriptError):
        await client.execute_command("EVALSHA", "0" * 40, 0)
    assert await client.hmget(key, "a") == [b"1"]  # the connection is still in step after the error
    first = await _connection_id(hot)
    await client.hmget(key, "a")
    assert await _connection_id(hot) == first
    await hot.close()


async def test_a_hot_command_while_one_is_in_flight_takes_the_clients_path(client: aioredis.Redis,
                                                                          experiment: str) -> None:
    """Concurrent hot commands all get their own answers (the ones that find the connection busy
    go through the pool)."""
    keys = [f"{experiment}:k{i}" for i in range(20)]
    for i, key in enumerate(keys):
        await client.hset(key, "v", str(i))
    HotConnection.install(client)
    answers = await asyncio.gather(*(client.hmget(key, ["v"]) for key in keys))
    assert answers == [[str(i).encode()] for i in range(20)]


async def test_a_lost_connection_costs_no_command(client: aioredis.Redis, experiment: str) -> None:
    """The hot connection killed by the server: the next hot command is answered all the same, and
    the one after it on the hot connection again."""
    key = f"{experiment}:h"
    await client.hset(key, "a", "1")
    hot = HotConnection.install(client)
    assert await client.hmget(key, "a") == [b"1"]
    hot_id = await _connection_id(hot)
    await client.client_kill_filter(_id=hot_id)
    assert await client.hmget(key, "a") == [b"1"]
    assert await client.hmget(key, "a") == [b"1"]
    assert await _connection_id(hot) != hot_id  # reconnected


async def _connection_id(hot: HotConnection) -> int:
    """The server's id of the hot connection."""
    assert hot._conn is not None
    await hot._conn.send_command("CLIENT", "ID")
    return int(await hot._conn.read_response())
