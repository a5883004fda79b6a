"""Entries that decode but hold unusable values, and entries too large to dead-letter whole: each is
dead-lettered with the reason and acknowledged, and the stream goes on (issue 20, item 7)."""

from __future__ import annotations

import asyncio
import math

import pytest

from fulmen import codec
from fulmen import keys as k
from fulmen.store import RedisStore
from fulmen.store.redis.stream import DEAD_LETTER_TRUNCATED_BYTES


async def test_a_dead_letter_too_large_for_a_record_keeps_a_truncated_copy(store: RedisStore) -> None:
    """A queue entry of 200 fields of 70 KB is dead-lettered truncated, with the reason; claiming goes on."""
    await store.queue.ensure()
    fields = {f"f{i}".encode(): bytes([i % 251]) * 70_000 for i in range(200)}
    poison_id = (await store.redis.xadd(store.keys.queue, fields)).decode()
    await store.rollouts.enqueue_rollout("x", rollout_id="good")
    claimed = await store.queue.dequeue_rollouts("w1", count=1)
    assert [c.rollout.rollout_id for c in claimed] == ["good"]
    (letter,) = await store.dead_letters.query_dead_letters()
    assert letter.entry_id == poison_id
    assert "queue entry has no 'm' field" in letter.reason and "dead letter truncated" in letter.reason
    assert 0 < len(letter.payload) <= 200 and all(len(v) < 70_000 for v in letter.payload.values())
    assert sum(map(len, letter.payload.values())) <= DEAD_LETTER_TRUNCATED_BYTES
    assert letter.payload["f0"] == fields[b"f0"][: len(letter.payload["f0"])]
    assert (await store.redis.xpending(store.keys.queue, k.RUNNERS_GROUP))["pending"] == 0


@pytest.mark.parametrize("rollout_id", ["", "a b", "x" * 200])
async def test_a_queue_entry_with_an_invalid_rollout_id_is_dead_lettered(store: RedisStore, rollout_id: str) -> None:
    """A queue entry naming no valid rollout id is refused at decode, with the reason."""
    await store.queue.ensure()
    await store.redis.xadd(store.keys.queue, {"m": codec.pack_record("queue", {"rollout_id": rollout_id})})
    await store.rollouts.enqueue_rollout("x", rollout_id="good")
    assert [c.rollout.rollout_id for c in await store.queue.dequeue_rollouts("w1", count=1)] == ["good"]
    (letter,) = await store.dead_letters.query_dead_letters()
    assert "rollout_id" in letter.reason



RESOURCES_GARBAGE = [
    pytest.param({b"x": b"1"}, id="no-m-field"),
    pytest.param({b"m": b"\xc1garbage"}, id="not-msgpack"),
    pytest.param({b"m": codec.pack_record("resources", {"resources_id": "p", "version": "7", "resources": {},
                                                        "create_time": 1.0})}, id="string-version"),
    pytest.param({b"m": codec.pack_record("resources", {"resources_id": "p", "version": 7,
                                                        "resources": {"llm": {"model_version": 3}},
                                                        "create_time": 1.0})}, id="numeric-model-version"),
    pytest.param({b"m": codec.pack_record("resources", {"resources_id": "p", "version": 7, "resources": {},
                                                        "create_time": math.nan})}, id="nan-time"),
]


@pytest.mark.parametrize("fields", RESOURCES_GARBAGE)
async def test_a_garbage_resources_log_tail_is_passed_over(real_store: RedisStore, fields: dict) -> None:
    """Latest resources skip an unreadable tail; a follower skips the entry and sees the next version."""
    store = real_store
    first = await store.resources.add_resources({"llm": {"model_version": "v1"}}, "policy")
    subscription = store.resources.subscribe_resources(after_version=first.version)
    following = asyncio.ensure_future(anext(subscription))
    await store.redis.xadd(store.keys.resources_log, fields)
    latest = await store.resources.get_latest_resources()
    assert latest is not None and latest.version == first.version
    assert [u.version for u in await store.resources.query_resources()] == [first.version]
    second = await store.resources.update_resources("policy", {"llm": {"model_version": "v2"}})
    assert (await asyncio.wait_for(following, 10)).version == second.version
    await subscription.aclose()
