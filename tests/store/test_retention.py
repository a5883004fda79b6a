"""Retention trims only what every consumer group acknowledged."""

from __future__ import annotations

import pytest

from fulmen.errors import InvalidInput, NotFound
from fulmen.records import Span
from fulmen.retention.cuts import safe_cut, trim_below
from fulmen.retention.trim import RetentionPolicy, trim
from fulmen.store import RedisStore


async def _finish(store: RedisStore, rollout_ids: list[str]) -> None:
    for rid in rollout_ids:
        await store.rollouts.enqueue_rollout({"task": rid}, rollout_id=rid)
    for claimed in await store.queue.dequeue_rollouts("w", len(rollout_ids)):
        aid = claimed.attempt.attempt_id
        await store.spans.add_spans([Span(claimed.rollout.rollout_id, aid, "s1", "llm")])
        await store.rollouts.update_attempt(claimed.rollout.rollout_id, aid, status="succeeded")


async def test_policy_needs_a_limit() -> None:
    """A policy with neither age nor count is refused."""
    with pytest.raises(InvalidInput):
        RetentionPolicy()


async def test_nothing_trimmed_without_consumer_groups(store: RedisStore) -> None:
    """Completions that no group has read are never trimmed, however old."""
    await _finish(store, ["a", "b"])
    report = await trim(store, RetentionPolicy(max_age_s=0))
    assert report.finished == 0
    assert await store.redis.xlen(store.keys.finished) == 2
    assert len(await store.spans.query_spans("a")) == 1


async def test_trims_only_acknowledged_completions(store: RedisStore) -> None:
    """With two groups, only entries both acknowledged go, and their spans with them."""
    await store.finished.ensure_finished_group("adapter")
    await store.finished.ensure_finished_group("algorithm")
    await _finish(store, ["a", "b", "c"])
    adapter = await store.finished.read_finished("adapter", "x", count=10)
    await store.finished.ack_finished("adapter", [c.entry_id for c in adapter])
    algorithm = await store.finished.read_finished("algorithm", "y", count=2)  # reads a, b; acks only a
    assert [c.rollout_id for c in algorithm] == ["a", "b"]
    await store.finished.ack_finished("algorithm", [algorithm[0].entry_id])

    report = await trim(store, RetentionPolicy(max_age_s=0))

    assert (report.finished, report.span_streams) == (1, 1)
    assert await store.spans.query_spans("a") == []
    assert [s.span_id for s in await store.spans.query_spans("b")] == ["s1"]  # pending in algorithm: kept
    remaining = await store.redis.xrange(store.keys.finished)
    assert len(remaining) == 2
    assert (await store.rollouts.get_rollout("a")).status == "succeeded"  # records kept unless asked


async def test_age_zero_takes_entries_of_this_very_millisecond(store: RedisStore) -> None:
    """max_age_s=0 removes every acknowledged entry up to now, those written in the same millisecond
    as the trim's clock reading included; a later one stays."""
    key, redis = store.keys.samples, store.redis
    for entry_id in ("1000-0", "1000-1", "1001-0"):
        await redis.xadd(key, {"m": b"x"}, id=entry_id)
    await redis.xgroup_create(key, "g", id="0")
    read = await redis.xreadgroup("g", "c", {key: ">"}, count=10)
    await redis.xack(key, "g", *[entry_id for entry_id, _ in read[0][1]])

    cut = await safe_cut(redis, key, 0, None, now_ms=1000)

    assert await trim_below(redis, key, cut, dry_run=False) == 2
    assert [entry_id for entry_id, _ in await redis.xrange(key)] == [b"1001-0"]


async def test_count_policy_and_delete_rollouts(store: RedisStore) -> None:
    """max_count keeps the newest entries; delete_rollouts removes the trimmed rollouts too."""
    await store.finished.ensure_finished_group("adapter")
    await _finish(store, ["a", "b", "c"])
    done = await store.finished.read_finished("adapter", "x", count=10)
    await store.finished.ack_finished("adapter", [c.entry_id for c in done])

    report = await trim(store, RetentionPolicy(max_count=1, delete_rollouts=True))

    assert (report.finished, report.rollouts) == (2, 2)
    with pytest.raises(NotFound):
        await store.rollouts.get_rollout("a")
    assert [r.rollout_id for r in await store.rollouts.query_rollouts()] == ["c"]
    assert (await store.statistics())["rollouts"]["succeeded"] == 1


async def test_queue_keeps_unclaimed_entries(store: RedisStore) -> None:
    """Claimed queue entries are trimmed; entries not yet claimed stay."""
    await store.rollouts.enqueue_rollout({}, rollout_id="a")
    await store.rollouts.enqueue_rollout({}, rollout_id="b")
    await store.queue.dequeue_rollouts("w", 1)
    report = await trim(store, RetentionPolicy(max_age_s=0))
    assert report.queue_entries == 1
    assert [c.rollout.rollout_id for c in await store.queue.dequeue_rollouts("w", 5)] == ["b"]


async def test_pending_entry_is_kept(store: RedisStore) -> None:
    """An entry delivered but not acknowledged (pending) blocks trimming from it on."""
    await store.finished.ensure_finished_group("adapter")
    await _finish(store, ["a", "b"])
    done = await store.finished.read_finished("adapter", "x", count=10)
    await store.finished.ack_finished("adapter", [done[1].entry_id])  # a still pending
    report = await trim(store, RetentionPolicy(max_age_s=0))
    assert report.finished == 0
    assert len(await store.spans.query_spans("a")) == 1
