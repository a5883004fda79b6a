"""Retries under each retry_condition, and the watchdog that detects timeouts and silent workers."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from fulmen.records import RolloutFinished
from fulmen.records.status import AttemptStatus, RolloutStatus
from fulmen.store import RedisStore
from fulmen.watchdog import run_watchdog, sweep

# Deadlines short enough to keep the suite fast, with sleeps well past them so a slow machine
# cannot make a test flaky. Time is the Redis server's clock, so the sleeps only need to be long.
DEADLINE_S = 0.3
PAST_DEADLINE_S = 0.45


async def _completions(store: RedisStore) -> list[tuple[str, str, str | None]]:
    entries = await store.redis.xrange(store.keys.finished)
    return [
        (c.rollout_id, c.status.value, c.attempt_id)
        for c in (RolloutFinished.from_wire(f[b"m"]) for _, f in entries)
    ]


async def _claim(store: RedisStore, expected_attempt: str) -> None:
    claimed = await store.queue.dequeue_rollout("w1")
    assert claimed is not None
    assert claimed.attempt.attempt_id == expected_attempt
    assert claimed.rollout.status is RolloutStatus.PREPARING


async def _statuses(store: RedisStore, rollout_id: str) -> list[str]:
    return [a.status.value for a in await store.rollouts.query_attempts(rollout_id)]


# --- failed -----------------------------------------------------------------------------------------


async def test_failed_is_retried_until_max_attempts(store: RedisStore) -> None:
    """With retry on failed, each failure requeues until max_attempts, then the rollout fails."""
    config = {"max_attempts": 3, "retry_condition": ["failed"]}
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", config=config)
    for n in (1, 2):
        await _claim(store, f"r1.{n}")
        assert await store.rollouts.update_attempt("r1", f"r1.{n}", status="failed", error="bad") == "requeued"
        rollout = await store.rollouts.get_rollout("r1")
        assert rollout.status is RolloutStatus.REQUEUING
        assert (rollout.attempt_count, rollout.end_time) == (n, None)
        assert [r.rollout_id for r in await store.rollouts.query_rollouts(status="requeuing")] == ["r1"]
        assert await _completions(store) == []
    await _claim(store, "r1.3")
    assert await store.rollouts.update_attempt("r1", "r1.3", status="failed") == "failed"
    rollout = await store.rollouts.get_rollout("r1")
    assert rollout.status is RolloutStatus.FAILED and rollout.end_time is not None
    assert await _statuses(store, "r1") == ["failed", "failed", "failed"]
    assert await _completions(store) == [("r1", "failed", "r1.3")]
    assert await store.queue.dequeue_rollouts("w1", count=5) == []


async def test_success_after_a_retry(store: RedisStore) -> None:
    """A rollout whose second attempt succeeds ends succeeded, with one completion."""
    await store.rollouts.enqueue_rollout(
        "x", rollout_id="r1", config={"max_attempts": 2, "retry_condition": ["failed"]}
    )
    await _claim(store, "r1.1")
    assert await store.rollouts.update_attempt("r1", "r1.1", status="failed") == "requeued"
    await _claim(store, "r1.2")
    assert await store.rollouts.update_attempt("r1", "r1.2", status="succeeded") == "succeeded"
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.SUCCEEDED
    assert await _statuses(store, "r1") == ["failed", "succeeded"]
    assert await _completions(store) == [("r1", "succeeded", "r1.2")]


@pytest.mark.parametrize(
    "config",
    [
        {"max_attempts": 3, "retry_condition": ["timeout", "unresponsive"]},
        {"max_attempts": 3},
        {"retry_condition": ["failed"]},  # max_attempts defaults to 1: no attempt left
    ],
)
async def test_failure_without_retry_fails_at_once(store: RedisStore, config: dict) -> None:
    """A failure not listed in retry_condition, or with no attempt left, fails the rollout at once."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", config=config)
    await _claim(store, "r1.1")
    assert await store.rollouts.update_attempt("r1", "r1.1", status="failed") == "failed"
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.FAILED
    assert await _completions(store) == [("r1", "failed", "r1.1")]
    assert await store.queue.dequeue_rollouts("w1", count=5) == []


# --- timeout and unresponsive, detected by the watchdog ------------------------------------------


@pytest.mark.parametrize("kind", ["timeout", "unresponsive"])
async def test_expiry_is_retried_then_failed(real_store: RedisStore, kind: str) -> None:
    """An attempt past its deadline is requeued while attempts remain, then the rollout fails."""
    store = real_store
    config = {f"{kind}_seconds": DEADLINE_S, "max_attempts": 2, "retry_condition": [kind]}
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", config=config)
    await _claim(store, "r1.1")
    assert await sweep(store) == Counter()  # not overdue yet
    await asyncio.sleep(PAST_DEADLINE_S)
    assert await sweep(store) == Counter({"requeued": 1})
    attempt = await store.rollouts.get_attempt("r1.1")
    assert attempt.status is AttemptStatus(kind)
    assert attempt.error == {"type": "Error", "message": f"attempt {kind}"}
    assert attempt.end_time is not None
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.REQUEUING
    assert await sweep(store) == Counter()  # an ended attempt is no longer watched

    await _claim(store, "r1.2")
    await asyncio.sleep(PAST_DEADLINE_S)
    assert await sweep(store) == Counter({"failed": 1})
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.FAILED
    assert await _statuses(store, "r1") == [kind, kind]
    assert await _completions(store) == [("r1", "failed", "r1.2")]
    assert await store.redis.zcard(store.keys.watch_deadline) == 0
    assert await store.redis.zcard(store.keys.watch_heartbeat) == 0


@pytest.mark.parametrize("kind", ["timeout", "unresponsive"])
async def test_expiry_not_listed_fails_at_once(real_store: RedisStore, kind: str) -> None:
    """An expiry not named in retry_condition fails the rollout although attempts remain."""
    store = real_store
    config = {f"{kind}_seconds": DEADLINE_S, "max_attempts": 3, "retry_condition": ["failed"]}
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", config=config)
    await _claim(store, "r1.1")
    await asyncio.sleep(PAST_DEADLINE_S)
    assert await sweep(store) == Counter({"failed": 1})
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus(kind)
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.FAILED
    assert await _completions(store) == [("r1", "failed", "r1.1")]


async def test_heartbeat_keeps_attempt_alive(real_store: RedisStore) -> None:
    """Heartbeats more often than unresponsive_seconds keep the attempt running; silence ends it."""
    store = real_store
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", config={"unresponsive_seconds": 0.6})
    await _claim(store, "r1.1")
    for _ in range(6):  # 0.9 s in all, past the unresponsive limit; 0.45 s of slack per beat
        await asyncio.sleep(0.15)
        assert await store.spans.heartbeat("r1", "r1.1") == (RolloutStatus.RUNNING, AttemptStatus.RUNNING)
        assert await sweep(store) == Counter()
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.RUNNING
    await asyncio.sleep(0.8)
    assert await sweep(store) == Counter({"failed": 1})
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.UNRESPONSIVE
    assert await store.spans.heartbeat("r1", "r1.1") == (RolloutStatus.FAILED, AttemptStatus.UNRESPONSIVE)


async def test_heartbeat_does_not_extend_timeout(real_store: RedisStore) -> None:
    """timeout_seconds counts from the attempt's start, however alive the worker is."""
    store = real_store
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", config={"timeout_seconds": DEADLINE_S})
    await _claim(store, "r1.1")
    for _ in range(3):
        await asyncio.sleep(PAST_DEADLINE_S / 3 + 0.02)
        await store.spans.heartbeat("r1", "r1.1")
    assert await sweep(store) == Counter({"failed": 1})
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.TIMEOUT


async def test_fresh_when_not_overdue(store: RedisStore) -> None:
    """An attempt whose watch entry looks overdue but is not is left alone as 'fresh'."""
    await store.rollouts.enqueue_rollout(
        "x", rollout_id="r1", config={"timeout_seconds": 60, "unresponsive_seconds": 60}
    )
    await _claim(store, "r1.1")
    due = await store.redis.zscore(store.keys.watch_deadline, "r1.1")
    # Pretend a stale score (as a racing watchdog may leave): the script re-checks the real deadline.
    await store.redis.zadd(store.keys.watch_deadline, {"r1.1": 0})
    await store.redis.zadd(store.keys.watch_heartbeat, {"r1.1": 0})
    assert await sweep(store) == Counter({"fresh": 2})
    assert await store.redis.zscore(store.keys.watch_deadline, "r1.1") == pytest.approx(due)
    assert await store.redis.zscore(store.keys.watch_heartbeat, "r1.1") >= due
    assert await store.rollouts.expire_attempt("r1", "r1.1", AttemptStatus.TIMEOUT) == "fresh"
    assert await store.rollouts.expire_attempt("r1", "r1.1", AttemptStatus.UNRESPONSIVE) == "fresh"
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.PREPARING
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.PREPARING


async def test_expire_without_configured_limit_is_fresh(store: RedisStore) -> None:
    """An attempt of a rollout with no timeouts never expires."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1")
    await _claim(store, "r1.1")
    assert await store.redis.zcard(store.keys.watch_deadline) == 0
    assert await store.rollouts.expire_attempt("r1", "r1.1", AttemptStatus.TIMEOUT) == "fresh"
    assert await store.rollouts.expire_attempt("r1", "r1.1", AttemptStatus.UNRESPONSIVE) == "fresh"
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.PREPARING


async def test_expire_of_ended_or_unknown_attempt(store: RedisStore) -> None:
    """Expiring an attempt that already ended returns 'already' and unwatches it; unknown is 'missing'."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", config={"timeout_seconds": 60})
    await _claim(store, "r1.1")
    await store.rollouts.update_attempt("r1", "r1.1", status="succeeded")
    await store.redis.zadd(store.keys.watch_deadline, {"r1.1": 0})
    assert await sweep(store) == Counter({"already": 1})
    assert await store.redis.zcard(store.keys.watch_deadline) == 0
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.SUCCEEDED
    assert await store.rollouts.expire_attempt("nope", "nope.1", AttemptStatus.TIMEOUT) == "missing"


async def test_concurrent_sweeps_end_an_attempt_once(real_store: RedisStore) -> None:
    """Two watchdogs sweeping at once transition an overdue attempt exactly once."""
    store = real_store
    config = {"timeout_seconds": DEADLINE_S, "max_attempts": 2, "retry_condition": ["timeout"]}
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", config=config)
    await _claim(store, "r1.1")
    await asyncio.sleep(PAST_DEADLINE_S)
    outcomes = sum(await asyncio.gather(sweep(store), sweep(store), sweep(store)), Counter())
    assert outcomes["requeued"] == 1
    assert set(outcomes) <= {"requeued", "already"}
    assert await store.redis.xlen(store.keys.queue) == 2  # the first entry and one requeue


async def test_run_watchdog_fails_silent_attempt(real_store: RedisStore) -> None:
    """The watchdog loop ends a silent attempt and the rollout's waiter sees it finish."""
    store = real_store
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", config={"unresponsive_seconds": DEADLINE_S})
    await _claim(store, "r1.1")
    stop = asyncio.Event()
    task = asyncio.create_task(run_watchdog(store, interval_s=0.05, stop=stop))
    try:
        finished = await store.finished.wait_for_rollouts(["r1"], timeout_s=10)
    finally:
        stop.set()
        await task
    assert [(r.rollout_id, r.status) for r in finished] == [("r1", RolloutStatus.FAILED)]
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.UNRESPONSIVE
