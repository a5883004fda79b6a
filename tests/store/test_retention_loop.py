"""The watchdog's retention loop: it trims by its policy when it starts and again every interval,
and never what a group has not acknowledged."""

from __future__ import annotations

import asyncio

from fulmen.records import Span
from fulmen.retention.trim import RetentionPolicy
from fulmen.store import RedisStore
from fulmen.watchdog import RetentionSchedule, run_watchdog


async def _until(check, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Wait for ``check()`` to hold (a generous bound: the loop passes every 50 ms)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "the retention loop did not trim in time"
        await asyncio.sleep(0.02)


async def test_watchdog_trims_by_policy_and_again_each_interval(store: RedisStore) -> None:
    """With a schedule, the watchdog trims acknowledged finished entries (and their spans), keeps
    the one the adapter has not acknowledged, and trims it on a later pass once acknowledged."""
    await store.finished.ensure_finished_group("adapter")
    for rid in ("a", "b"):
        await store.rollouts.enqueue_rollout({}, rollout_id=rid)
    for c in await store.queue.dequeue_rollouts("w", 2):
        await store.spans.add_spans([Span(c.rollout.rollout_id, c.attempt.attempt_id, "s1", "llm")])
        await store.rollouts.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status="succeeded")
    a, b = await store.finished.read_finished("adapter", "x", count=2)
    await store.finished.ack_finished("adapter", [a.entry_id])
    stop = asyncio.Event()
    schedule = RetentionSchedule(RetentionPolicy(max_count=0), interval_s=0.05)
    task = asyncio.create_task(run_watchdog(store, interval_s=0.05, stop=stop, retention=schedule))
    try:
        await _until(lambda: _finished_left(store, 1))
        assert await store.spans.query_spans(a.rollout_id) == []
        assert len(await store.spans.query_spans(b.rollout_id)) == 1  # not acknowledged: kept, pass after pass
        await store.finished.ack_finished("adapter", [b.entry_id])
        await _until(lambda: _finished_left(store, 0))
        assert await store.spans.query_spans(b.rollout_id) == []
    finally:
        stop.set()
        await task


async def _finished_left(store: RedisStore, n: int) -> bool:
    return int(await store.redis.xlen(store.keys.finished)) == n
