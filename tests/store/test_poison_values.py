"""Entries that decode but hold unusable values, and entries too large to dead-letter whole: each is
dead-lettered with the reason and acknowledged, and the stream goes on (issue 20, item 7)."""

from __future__ import annotations

import pytest

from fulmen import codec
from fulmen import keys as k
from fulmen.store import RedisStore
from fulmen.store.stream import DEAD_LETTER_TRUNCATED_BYTES


async def test_a_dead_letter_too_large_for_a_record_keeps_a_truncated_copy(store: RedisStore) -> None:
    """A queue entry of 200 fields of 70 KB is dead-lettered truncated, with the reason; claiming goes on."""
    await store.ensure()
    fields = {f"f{i}".encode(): bytes([i % 251]) * 70_000 for i in range(200)}
    poison_id = (await store.redis.xadd(store.keys.queue, fields)).decode()
    await store.enqueue_rollout("x", rollout_id="good")
    claimed = await store.dequeue_rollouts("w1", count=1)
    assert [c.rollout.rollout_id for c in claimed] == ["good"]
    (letter,) = await store.query_dead_letters()
    assert letter.entry_id == poison_id
    assert "queue entry has no 'm' field" in letter.reason and "dead letter truncated" in letter.reason
    assert 0 < len(letter.payload) <= 200 and all(len(v) < 70_000 for v in letter.payload.values())
    assert sum(map(len, letter.payload.values())) <= DEAD_LETTER_TRUNCATED_BYTES
    assert letter.payload["f0"] == fields[b"f0"][: len(letter.payload["f0"])]
    assert (await store.redis.xpending(store.keys.queue, k.RUNNERS_GROUP))["pending"] == 0


@pytest.mark.parametrize("rollout_id", ["", "a b", "x" * 200])
async def test_a_queue_entry_with_an_invalid_rollout_id_is_dead_lettered(store: RedisStore, rollout_id: str) -> None:
    """A queue entry naming no valid rollout id is refused at decode, with the reason."""
    await store.ensure()
    await store.redis.xadd(store.keys.queue, {"m": codec.pack_record("queue", {"rollout_id": rollout_id})})
    await store.enqueue_rollout("x", rollout_id="good")
    assert [c.rollout.rollout_id for c in await store.dequeue_rollouts("w1", count=1)] == ["good"]
    (letter,) = await store.query_dead_letters()
    assert "rollout_id" in letter.reason

