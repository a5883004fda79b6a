"""The Stream primitive step by step on a real server: group, read, ack, reclaim, dead letters, follow."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from fulmen.errors import RecordError
from fulmen.records import DeadLetter
from fulmen.store import RedisStore
from fulmen.store.redis.stream import Stream


def _decode(entry_id: str, fields: Mapping[bytes, bytes]) -> str:
    value = fields.get(b"m")
    if value is None or value == b"poison":
        raise RecordError("not a test record")
    return value.decode()


def _stream(store: RedisStore, group: str | None = "g") -> Stream[str]:
    return store.ctx.stream(store.keys.prefix + "test", _decode, group=group)


async def test_reclaim_step_by_step(real_store: RedisStore) -> None:
    """Entries pending in a dead consumer move, once idle, to the reclaimer; the cursor goes on
    from where it stopped; deleted entries are skipped; poison is dead-lettered and acked."""
    stream = _stream(real_store)
    redis = real_store.redis
    ids = [(await redis.xadd(stream.key, {"m": f"e{i}"})).decode() for i in range(5)]
    assert [v for _, v in await stream.read("dead", count=10)] == [f"e{i}" for i in range(5)]

    # 1. nothing idle long enough: nothing moves
    assert await stream.reclaim("alive", min_idle_ms=60_000, count=2) == []
    # 2. idle: two at a time, following the cursor
    await asyncio.sleep(0.02)
    assert await stream.reclaim("alive", min_idle_ms=10, count=2) == [(ids[0], "e0"), (ids[1], "e1")]
    # 3. an entry deleted while pending (trimmed) is skipped, on Redis 6.2 (nil) and 7 (deleted ids)
    await redis.xdel(stream.key, ids[2])
    got = await stream.reclaim("alive", min_idle_ms=10, count=2)
    assert ids[2] not in [eid for eid, _ in got] and (ids[3], "e3") in got
    # 4. the cursor wraps around: the rest, then nothing more (all now belong to "alive", freshly)
    rest = await stream.reclaim("alive", min_idle_ms=10, count=10)
    assert [eid for eid, _ in rest] in ([ids[4]], [])
    pending = await redis.xpending_range(stream.key, "g", "-", "+", 10)
    assert {p["consumer"] for p in pending} == {b"alive"}
    # 5. acked entries are gone from the pending list
    assert await stream.ack(ids[:2]) == 2
    assert await stream.ack(ids[:2]) == 0

    # 6. a poison entry reclaimed is dead-lettered with the reason and acked
    poison = (await redis.xadd(stream.key, {"m": "poison"})).decode()
    assert await stream.read("dead2", count=10) == []  # dead-lettered on read already
    (letter,) = await real_store.dead_letters.query_dead_letters()
    assert isinstance(letter, DeadLetter) and (letter.source, letter.entry_id) == (stream.key, poison)
    assert letter.reason == "not a test record"
    assert poison not in [p["message_id"].decode() for p in await redis.xpending_range(stream.key, "g", "-", "+", 10)]


async def test_group_is_created_again_after_the_stream_is_deleted(real_store: RedisStore) -> None:
    """A read after the stream (and its group) was deleted recreates the group and goes on."""
    stream = _stream(real_store)
    await stream.ensure_group()
    await stream.ensure_group()  # BUSYGROUP is fine
    await real_store.redis.delete(stream.key)
    assert await stream.read("c") == []
    await real_store.redis.xadd(stream.key, {"m": "after"})
    assert [v for _, v in await stream.read("c")] == ["after"]


async def test_pending_pages_on_from_the_last_id(real_store: RedisStore) -> None:
    """Pending entries are re-read from the one after ``after``, so a page never repeats."""
    stream = _stream(real_store)
    for i in range(3):
        await real_store.redis.xadd(stream.key, {"m": f"p{i}"})
    first = await stream.read("c", count=3)
    page1 = await stream.read("c", count=2, pending=True)
    page2 = await stream.read("c", count=2, pending=True, after=page1[-1][0])
    assert page1 + page2 == first


async def test_follow_from_now_and_from_an_id(real_store: RedisStore) -> None:
    """follow() starts after the newest entry; from an id it replays what came after; poison is skipped."""
    stream = _stream(real_store, group=None)
    first = (await real_store.redis.xadd(stream.key, {"m": "old"})).decode()
    cursor = await stream.cursor()
    assert await cursor.read(0.01) == []
    await real_store.redis.xadd(stream.key, {"m": "poison"})
    await real_store.redis.xadd(stream.key, {"m": "new"})
    assert [v for _, v in await cursor.read(0.01)] == ["new"]

    replay = stream.follow(after="0-0")
    assert (await anext(replay))[1] == "old"
    assert (await anext(replay))[1] == "new"
    from_first = stream.follow(after=first)
    assert (await asyncio.wait_for(anext(from_first), 5))[1] == "new"
    now = stream.follow()
    waiting = asyncio.ensure_future(anext(now))
    await asyncio.sleep(0.05)
    await real_store.redis.xadd(stream.key, {"m": "later"})
    assert (await asyncio.wait_for(waiting, 5))[1] == "later"
    with pytest.raises(TypeError):
        await stream.ack(["1-0"])  # a broadcast stream has no group
