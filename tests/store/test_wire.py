"""The auto-pipeline's wire (`fulmen.store.redis.wire`): script calls on a connection of their own,
one round trip at a time, and what goes through the client again when that connection fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from fulmen.store.redis import wire as wire_module
from fulmen.store.redis.autopipeline import AutoPipeline
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.store.redis.wire import Wire

PUSH = "redis.call('RPUSH', KEYS[1], ARGV[1]) return ARGV[1]"
FAIL = "return redis.error_reply('NOPE ' .. ARGV[1])"


@pytest.fixture
async def client(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def admin(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    """Another client, to pause the server and kill connections."""
    admin = aioredis.from_url(redis_server.url)
    yield admin
    await admin.client_unpause()
    await admin.aclose()


async def _pipeline(client: aioredis.Redis, *sources: str) -> tuple[AutoPipeline, list[Any]]:
    scripts = [client.register_script(source) for source in sources]

    async def load() -> None:
        for script in scripts:
            script.sha = await client.script_load(script.script)

    pipeline = AutoPipeline(client, prepare=load, reload=load)
    return pipeline, scripts


async def _on_wire(pipeline: AutoPipeline) -> Wire:
    """The pipeline's wire, once a first call went through the client."""
    for _ in range(100):
        if pipeline._wire is not None and pipeline._wire.open:
            return pipeline._wire
        await asyncio.sleep(0.01)
    raise AssertionError("the auto-pipeline took no connection for its wire")


async def _wire_id(wire: Wire) -> int:
    answered: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    wire.send([("CLIENT", "ID")], answered.set_result)
    return int((await answered)[0])


async def test_calls_after_the_first_take_the_wire_and_answer_as_through_the_client(
        client: aioredis.Redis, experiment: str) -> None:
    """Replies, error replies (as the caller's exception) and order are as through the client, and
    later round trips share the wire's one connection."""
    pipeline, (push, fail) = await _pipeline(client, PUSH, FAIL)
    log = f"{experiment}:log"
    assert await pipeline.submit(push, [log, "a"]) == b"a"  # through the client; the wire taken after
    wire = await _on_wire(pipeline)
    replies = await asyncio.gather(pipeline.submit(push, [log, "b"]), pipeline.submit(fail, [log, "x"]),
                                   pipeline.submit(push, [log, 3]), return_exceptions=True)
    assert replies[0] == b"b" and replies[2] == b"3"
    assert isinstance(replies[1], ResponseError) and "NOPE x" in str(replies[1])
    assert await client.lrange(log, 0, -1) == [b"a", b"b", b"3"]
    assert pipeline._wire is wire and wire.open
    await pipeline.aclose()


async def test_calls_made_during_a_round_trip_go_out_together_after_it(
        client: aioredis.Redis, admin: aioredis.Redis, experiment: str) -> None:
    """While one round trip waits on the server, the calls made meanwhile queue, then go out as one."""
    pipeline, (push,) = await _pipeline(client, PUSH)
    log = f"{experiment}:log"
    await pipeline.submit(push, [log, "first"])
    wire = await _on_wire(pipeline)
    sent: list[int] = []
    send = wire.send
    wire.send = lambda commands, answered: (sent.append(len(commands)), send(commands, answered))[1]  # type: ignore[method-assign]
    await admin.client_pause(300, all=False)  # writes wait
    first = pipeline.submit(push, [log, "0"])
    await asyncio.sleep(0.05)
    rest = [pipeline.submit(push, [log, str(i)]) for i in range(1, 6)]
    await asyncio.sleep(0.01)
    assert sent == [1]  # the five wait for the first round trip
    assert await asyncio.gather(first, *rest) == [str(i).encode() for i in range(6)]
    assert sent == [1, 5]
    assert await client.lrange(log, 1, -1) == [str(i).encode() for i in range(6)]
    await pipeline.aclose()


async def test_a_connection_lost_in_flight_sends_its_calls_again_through_the_client(
        client: aioredis.Redis, admin: aioredis.Redis, experiment: str) -> None:
    """The server kills the wire's connection while a call waits on it: the call is answered, through
    the client, once, and a new wire is taken."""
    pipeline, (push,) = await _pipeline(client, PUSH)
    log = f"{experiment}:log"
    await pipeline.submit(push, [log, "a"])
    wire = await _on_wire(pipeline)
    wire_id = await _wire_id(wire)
    await admin.client_pause(300, all=False)
    call = pipeline.submit(push, [log, "b"])
    await asyncio.sleep(0.05)
    await admin.client_kill_filter(_id=wire_id)
    assert await call == b"b"
    assert await client.lrange(log, 0, -1) == [b"a", b"b"]  # once
    assert not wire.open
    assert await pipeline.submit(push, [log, "c"]) == b"c"
    assert await _wire_id(await _on_wire(pipeline)) != wire_id
    await pipeline.aclose()


async def test_a_connection_lost_while_idle_costs_no_call(client: aioredis.Redis, admin: aioredis.Redis,
                                                         experiment: str) -> None:
    """The wire's connection killed between round trips: the next calls are answered all the same."""
    pipeline, (push,) = await _pipeline(client, PUSH)
    log = f"{experiment}:log"
    await pipeline.submit(push, [log, "a"])
    wire = await _on_wire(pipeline)
    await admin.client_kill_filter(_id=await _wire_id(wire))
    for value in "bcd":
        assert await pipeline.submit(push, [log, value]) == value.encode()
    assert await client.lrange(log, 0, -1) == [b"a", b"b", b"c", b"d"]
    await pipeline.aclose()


async def test_a_server_that_lost_its_scripts_gets_them_again_on_the_wire(
        client: aioredis.Redis, experiment: str) -> None:
    """NOSCRIPT on the wire: the scripts are loaded again and the calls sent again, in their order;
    the wire stays."""
    pipeline, (push,) = await _pipeline(client, PUSH)
    log = f"{experiment}:log"
    await pipeline.submit(push, [log, "a"])
    wire = await _on_wire(pipeline)
    await client.script_flush()
    assert await asyncio.gather(*(pipeline.submit(push, [log, v]) for v in "bcd")) == [b"b", b"c", b"d"]
    assert await client.lrange(log, 0, -1) == [b"a", b"b", b"c", b"d"]
    assert pipeline._wire is wire and wire.open
    await pipeline.aclose()


async def test_a_stalled_connection_is_dropped_and_its_call_answered(
        client: aioredis.Redis, admin: aioredis.Redis, experiment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No reply on the wire for STALL_S: its connection is dropped and the call goes through the client."""
    monkeypatch.setattr(wire_module, "STALL_S", 0.2)
    pipeline, (push,) = await _pipeline(client, PUSH)
    log = f"{experiment}:log"
    await pipeline.submit(push, [log, "a"])
    wire = await _on_wire(pipeline)
    await admin.client_pause(1500, all=False)
    call = pipeline.submit(push, [log, "b"])
    await asyncio.sleep(0.8)
    assert not wire.open  # dropped before the pause ended
    assert await call == b"b"
    await pipeline.aclose()


async def test_closing_gives_the_connection_back(client: aioredis.Redis, admin: aioredis.Redis,
                                                 experiment: str) -> None:
    """`AutoPipeline.aclose` closes the wire's connection; the client goes on working."""
    pipeline, (push,) = await _pipeline(client, PUSH)
    await pipeline.submit(push, [f"{experiment}:log", "a"])
    wire_id = await _wire_id(await _on_wire(pipeline))
    await pipeline.aclose()
    ids = [int(c["id"]) for c in await admin.client_list()]
    assert wire_id not in ids
    assert await client.ping()


async def test_the_wire_takes_no_connection_from_the_callers_limit(redis_server: EmbeddedRedis, experiment: str) -> None:
    """With the wire taken, a client limited to N connections still runs N commands at once."""
    client = aioredis.from_url(redis_server.url, max_connections=5)
    try:
        pipeline, (push,) = await _pipeline(client, PUSH)
        await pipeline.submit(push, [f"{experiment}:log", "a"])
        await _on_wire(pipeline)
        blocked = [client.blpop([f"{experiment}:never"], timeout=0.3) for _ in range(5)]
        assert await asyncio.gather(*blocked) == [None] * 5
        await pipeline.aclose()
        assert client.connection_pool.max_connections == 5
    finally:
        await client.aclose()


async def test_commands_on_the_wire_answer_as_hiredis_reads_them(client: aioredis.Redis, experiment: str) -> None:
    """`on_wire` takes the wire itself (no script call first) and answers each command's reply in
    order, an error reply as its exception, beside the script calls' round trips."""
    pipeline, (push,) = await _pipeline(client, PUSH)
    key, log = f"{experiment}:k", f"{experiment}:log"
    replies = await pipeline.on_wire([(b"SET", key, b"v"), (b"GET", key), (b"INCR", key)])
    assert replies is not None and replies[:2] == [b"OK", b"v"]
    assert isinstance(replies[2], ResponseError) and "not an integer" in str(replies[2])
    wire = await _on_wire(pipeline)
    call = pipeline.submit(push, [log, "a"])
    assert await asyncio.gather(call, pipeline.on_wire([(b"GET", key)])) == [b"a", [b"v"]]
    assert pipeline._wire is wire and wire.open
    await pipeline.aclose()


async def test_commands_on_a_wire_lost_in_flight_answer_none(
        client: aioredis.Redis, admin: aioredis.Redis, experiment: str) -> None:
    """The wire's connection killed while commands wait on it: None, for the caller to send them
    through the client; the next commands take a new wire."""
    pipeline, _ = await _pipeline(client)
    key = f"{experiment}:k"
    assert await pipeline.on_wire([(b"SET", key, b"v")]) == [b"OK"]
    wire = await _on_wire(pipeline)
    wire_id = await _wire_id(wire)
    await admin.client_pause(300, all=False)  # writes wait
    write = asyncio.ensure_future(pipeline.on_wire([(b"SET", key, b"w")]))
    await asyncio.sleep(0.05)
    await admin.client_kill_filter(_id=wire_id)
    assert await write is None and not wire.open
    assert await pipeline.on_wire([(b"GET", key)]) in ([b"v"], [b"w"])  # whether the SET ran, the caller cannot know
    assert await _wire_id(await _on_wire(pipeline)) != wire_id
    await pipeline.aclose()


async def test_no_wire_for_a_client_whose_connections_cannot_be_taken(experiment: str) -> None:
    """A client with no socket to take over (fakeredis here; a cluster client likewise): None."""
    import fakeredis

    client = fakeredis.FakeAsyncRedis()
    pipeline = AutoPipeline(client)
    assert await pipeline.on_wire([(b"PING",)]) is None
    await client.aclose()
