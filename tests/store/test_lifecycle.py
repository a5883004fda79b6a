"""Every state transition of rollouts and attempts, the reports that change nothing, and input errors."""

from __future__ import annotations

import pytest

from fulmen import keys as k
from fulmen.errors import InvalidInput, InvalidTransition, NotFound
from fulmen.records import RolloutConfig, RolloutFinished, Span
from fulmen.records.status import AttemptStatus, RolloutMode, RolloutStatus
from fulmen.store import RedisStore


async def _finished(store: RedisStore) -> list[RolloutFinished]:
    entries = await store.redis.xrange(store.keys.finished)
    return [RolloutFinished.from_wire(f[b"m"], entry_id=eid.decode()) for eid, f in entries]


async def _pending(store: RedisStore) -> int:
    return (await store.redis.xpending(store.keys.queue, k.RUNNERS_GROUP))["pending"]


async def _ids_in(store: RedisStore, status: str) -> list[str]:
    return [r.rollout_id for r in await store.rollouts.query_rollouts(status=status)]


async def _claim(store: RedisStore, rollout_id: str = "r1", **kwargs: object):
    await store.rollouts.enqueue_rollout({"task": rollout_id}, rollout_id=rollout_id, **kwargs)
    claimed = await store.queue.dequeue_rollout("w1")
    assert claimed is not None and claimed.rollout.rollout_id == rollout_id
    return claimed


# --- enqueue and claim ----------------------------------------------------------------------------


async def test_enqueue_stores_a_queuing_rollout(store: RedisStore) -> None:
    """An enqueued rollout is stored as queuing with its input, mode, config and metadata."""
    rollout = await store.rollouts.enqueue_rollout(
        {"q": [1, 2]},
        rollout_id="r1",
        mode="train",
        resources_id="res-1",
        config={"max_attempts": 3, "retry_condition": ["failed"], "timeout_seconds": 5},
        metadata={"source": "gsm8k"},
    )
    assert rollout.rollout_id == "r1"
    assert rollout.status is RolloutStatus.QUEUING
    assert rollout.input == {"q": [1, 2]}
    assert rollout.mode is RolloutMode.TRAIN
    assert rollout.resources_id == "res-1"
    assert rollout.config == RolloutConfig(timeout_seconds=5.0, max_attempts=3, retry_condition=("failed",))
    assert rollout.metadata == {"source": "gsm8k"}
    assert isinstance(rollout.enqueue_time, float)
    assert (rollout.start_time, rollout.end_time) == (None, None)
    assert (rollout.attempt_count, rollout.attempt_id) == (0, None)
    assert await store.rollouts.get_rollout("r1") == rollout
    assert await _ids_in(store, "queuing") == ["r1"]
    assert await store.redis.xlen(store.keys.queue) == 1
    stats = await store.statistics()
    assert stats["rollouts"]["queuing"] == 1
    assert (stats["total_rollouts"], stats["queue_depth"], stats["active_attempts"]) == (1, 1, 0)


async def test_enqueue_without_id_generates_one(store: RedisStore) -> None:
    """A rollout enqueued without an id gets a fresh unique one."""
    a = await store.rollouts.enqueue_rollout("a")
    b = await store.rollouts.enqueue_rollout("b")
    assert a.rollout_id.startswith("ro-") and b.rollout_id.startswith("ro-")
    assert a.rollout_id != b.rollout_id
    assert (await store.rollouts.get_rollout(b.rollout_id)).input == "b"


async def test_claim_moves_rollout_and_attempt_to_preparing(store: RedisStore) -> None:
    """Claiming creates attempt 1 in preparing, owned by the worker, and acks the queue entry."""
    await store.rollouts.enqueue_rollout({"q": 1}, rollout_id="r1")
    claimed = await store.queue.dequeue_rollouts("w1", count=5)
    assert len(claimed) == 1
    rollout, attempt = claimed[0].rollout, claimed[0].attempt
    assert rollout.status is RolloutStatus.PREPARING
    assert (rollout.attempt_count, rollout.attempt_id) == (1, "r1.1")
    assert attempt.rollout_id == "r1"
    assert (attempt.attempt_id, attempt.sequence_id) == ("r1.1", 1)
    assert attempt.status is AttemptStatus.PREPARING
    assert attempt.worker_id == "w1"
    assert attempt.end_time is None and attempt.error is None
    assert rollout.start_time == attempt.start_time == attempt.last_heartbeat_time
    assert rollout.start_time >= rollout.enqueue_time
    assert await store.rollouts.get_rollout("r1") == rollout
    assert await store.rollouts.get_attempt("r1.1") == attempt
    assert await store.rollouts.get_latest_attempt("r1") == attempt
    assert await _ids_in(store, "queuing") == []
    assert await _ids_in(store, "preparing") == ["r1"]
    assert await _pending(store) == 0
    assert await store.queue.dequeue_rollouts("w2", count=5) == []


async def test_claim_takes_rollouts_in_enqueue_order(store: RedisStore) -> None:
    """Rollouts are claimed first in, first out, each by exactly one worker."""
    for rid in ["a", "b", "c"]:
        await store.rollouts.enqueue_rollout(rid, rollout_id=rid)
    first = await store.queue.dequeue_rollouts("w1", count=2)
    second = await store.queue.dequeue_rollouts("w2", count=2)
    assert [c.rollout.rollout_id for c in first] == ["a", "b"]
    assert [c.rollout.rollout_id for c in second] == ["c"]
    assert {c.attempt.worker_id for c in second} == {"w2"}


async def test_get_latest_attempt_is_none_before_a_claim(store: RedisStore) -> None:
    """A rollout never claimed has no attempt."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1")
    assert await store.rollouts.get_latest_attempt("r1") is None
    assert await store.rollouts.query_attempts("r1") == []


async def test_first_span_moves_to_running(store: RedisStore) -> None:
    """The first span of a preparing attempt moves attempt and rollout to running."""
    claimed = await _claim(store)
    await store.spans.add_span(Span("r1", "r1.1", "s1", "llm"))
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.RUNNING
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.RUNNING
    assert await _ids_in(store, "preparing") == []
    assert await _ids_in(store, "running") == [claimed.rollout.rollout_id]


async def test_heartbeat_moves_to_running(store: RedisStore) -> None:
    """A heartbeat of a preparing attempt moves it and its rollout to running."""
    await _claim(store)
    assert await store.spans.heartbeat("r1", "r1.1") == (RolloutStatus.RUNNING, AttemptStatus.RUNNING)
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.RUNNING
    assert await store.spans.heartbeat("r1", "r1.1") == (RolloutStatus.RUNNING, AttemptStatus.RUNNING)


async def test_report_running_moves_to_running(store: RedisStore) -> None:
    """Reporting status running is accepted as the move out of preparing."""
    await _claim(store)
    assert await store.rollouts.update_attempt("r1", "r1.1", status="running") == "running"
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.RUNNING
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.RUNNING


async def test_succeeded(store: RedisStore) -> None:
    """A succeeded attempt ends the rollout as succeeded and appends one finished entry."""
    await _claim(store)
    await store.spans.heartbeat("r1", "r1.1")
    assert await store.rollouts.update_attempt("r1", "r1.1", status=AttemptStatus.SUCCEEDED) == "succeeded"
    rollout = await store.rollouts.get_rollout("r1")
    attempt = await store.rollouts.get_attempt("r1.1")
    assert rollout.status is RolloutStatus.SUCCEEDED
    assert attempt.status is AttemptStatus.SUCCEEDED
    assert rollout.end_time is not None and attempt.end_time == rollout.end_time
    assert rollout.end_time >= rollout.start_time
    assert attempt.error is None
    assert await _ids_in(store, "running") == []
    assert await _ids_in(store, "succeeded") == ["r1"]
    assert [(c.rollout_id, c.status, c.attempt_id) for c in await _finished(store)] == [
        ("r1", RolloutStatus.SUCCEEDED, "r1.1")
    ]


async def test_failed_with_exception(store: RedisStore) -> None:
    """A failed attempt with no retry allowed fails the rollout and keeps the error."""
    await _claim(store)
    outcome = await store.rollouts.update_attempt("r1", "r1.1", status="failed", error=ValueError("boom"))
    assert outcome == "failed"
    rollout = await store.rollouts.get_rollout("r1")
    attempt = await store.rollouts.get_attempt("r1.1")
    assert rollout.status is RolloutStatus.FAILED and rollout.end_time is not None
    assert attempt.status is AttemptStatus.FAILED
    assert attempt.error is not None
    assert (attempt.error["type"], attempt.error["message"]) == ("ValueError", "boom")
    assert "ValueError: boom" in attempt.error["traceback"]
    assert [(c.rollout_id, c.status, c.attempt_id) for c in await _finished(store)] == [
        ("r1", RolloutStatus.FAILED, "r1.1")
    ]


async def test_failed_with_message(store: RedisStore) -> None:
    """An error given as a string is stored as a typed record."""
    await _claim(store)
    await store.rollouts.update_attempt("r1", "r1.1", status="failed", error="agent crashed")
    assert (await store.rollouts.get_attempt("r1.1")).error == {"type": "Error", "message": "agent crashed"}


async def test_update_attempt_worker_and_metadata(store: RedisStore) -> None:
    """Worker and metadata of an attempt change without a status report."""
    await _claim(store)
    assert await store.rollouts.update_attempt("r1", "r1.1", worker_id="w9", metadata={"gpu": 3}) is None
    attempt = await store.rollouts.get_attempt("r1.1")
    assert (attempt.worker_id, attempt.metadata, attempt.status) == ("w9", {"gpu": 3}, "preparing")


# --- manual attempts and start_rollout -----------------------------------------------------------


async def test_start_attempt_supersedes_the_active_attempt(store: RedisStore) -> None:
    """A manual attempt becomes the latest; the active one it replaces is marked failed."""
    await _claim(store)
    await store.spans.heartbeat("r1", "r1.1")
    started = await store.rollouts.start_attempt("r1", "w2")
    assert started.attempt.attempt_id == "r1.2"
    assert started.attempt.sequence_id == 2
    assert started.attempt.status is AttemptStatus.PREPARING
    assert started.attempt.worker_id == "w2"
    assert started.rollout.status is RolloutStatus.PREPARING
    assert (started.rollout.attempt_count, started.rollout.attempt_id) == (2, "r1.2")
    old = await store.rollouts.get_attempt("r1.1")
    assert old.status is AttemptStatus.FAILED and old.end_time is not None
    assert [a.attempt_id for a in await store.rollouts.query_attempts("r1")] == ["r1.1", "r1.2"]
    assert await _ids_in(store, "running") == []
    assert await _ids_in(store, "preparing") == ["r1"]
    assert await _finished(store) == []


async def test_start_attempt_of_queued_rollout_makes_queue_entry_stale(store: RedisStore) -> None:
    """A manual attempt of a queued rollout takes it off the queue: no worker claims it after."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1")
    started = await store.rollouts.start_attempt("r1", "w1")
    assert (started.rollout.status, started.attempt.attempt_id) == (RolloutStatus.PREPARING, "r1.1")
    assert await store.queue.dequeue_rollouts("w2", count=5) == []
    assert await _pending(store) == 0
    assert (await store.rollouts.get_rollout("r1")).attempt_count == 1


async def test_start_attempt_errors(store: RedisStore) -> None:
    """A manual attempt of an unknown or finished rollout is refused."""
    with pytest.raises(NotFound, match="rollout nope does not exist"):
        await store.rollouts.start_attempt("nope", "w1")
    await _claim(store)
    await store.rollouts.update_attempt("r1", "r1.1", status="succeeded")
    with pytest.raises(InvalidTransition, match="rollout r1 has finished"):
        await store.rollouts.start_attempt("r1", "w1")
    assert (await store.rollouts.get_rollout("r1")).attempt_count == 1


async def test_start_rollout_skips_the_queue(store: RedisStore) -> None:
    """start_rollout creates a rollout with its first attempt; nothing goes through the queue."""
    started = await store.rollouts.start_rollout({"q": 1}, "w1", rollout_id="r1", mode="val")
    assert started.rollout.rollout_id == "r1"
    assert started.rollout.status is RolloutStatus.PREPARING
    assert started.rollout.mode is RolloutMode.VAL
    assert started.rollout.input == {"q": 1}
    assert (started.attempt.attempt_id, started.attempt.worker_id) == ("r1.1", "w1")
    assert started.attempt.status is AttemptStatus.PREPARING
    assert await store.redis.xlen(store.keys.queue) == 0
    assert await store.queue.dequeue_rollouts("w2", count=5) == []
    assert await _ids_in(store, "queuing") == []
    assert await _ids_in(store, "preparing") == ["r1"]
    with pytest.raises(InvalidInput, match="rollout r1 already exists"):
        await store.rollouts.start_rollout({"q": 2}, "w1", rollout_id="r1")
    assert (await store.rollouts.get_rollout("r1")).input == {"q": 1}


# --- forced rollout statuses and cancel ----------------------------------------------------------


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
async def test_update_rollout_to_terminal_status(store: RedisStore, status: str) -> None:
    """Forcing a terminal status ends the active attempt as failed and appends one finished entry."""
    await _claim(store)
    await store.spans.heartbeat("r1", "r1.1")
    assert await store.rollouts.update_rollout("r1", status=status, reason="operator") == RolloutStatus(status)
    rollout = await store.rollouts.get_rollout("r1")
    attempt = await store.rollouts.get_attempt("r1.1")
    assert rollout.status is RolloutStatus(status) and rollout.end_time is not None
    assert attempt.status is AttemptStatus.FAILED
    assert attempt.error == {"type": "Error", "message": "operator"}
    assert await _ids_in(store, "running") == []
    assert await _ids_in(store, status) == ["r1"]
    assert [(c.rollout_id, c.status) for c in await _finished(store)] == [("r1", RolloutStatus(status))]
    assert await store.rollouts.update_rollout("r1", status="failed") is None  # terminal: nothing changes
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus(status)
    assert len(await _finished(store)) == 1


async def test_update_rollout_to_requeuing(store: RedisStore) -> None:
    """Requeuing a running rollout ends its attempt and queues it again for a new attempt."""
    await _claim(store)
    assert await store.rollouts.update_rollout("r1", status="requeuing") is RolloutStatus.REQUEUING
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.REQUEUING
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.FAILED
    assert await _ids_in(store, "requeuing") == ["r1"]
    assert (await store.statistics())["queue_depth"] == 1
    again = await store.queue.dequeue_rollout("w2")
    assert again is not None
    assert (again.attempt.attempt_id, again.attempt.worker_id) == ("r1.2", "w2")
    assert again.rollout.status is RolloutStatus.PREPARING
    assert await _finished(store) == []


async def test_release_attempt_requeues_at_once_even_without_retries(store: RedisStore) -> None:
    """A released attempt ends failed with the reason and its rollout is queued for another worker."""
    await _claim(store, config=RolloutConfig(max_attempts=1))
    assert await store.rollouts.release_attempt("r1", "r1.1", reason="runner w1 stopping") is True
    attempt = await store.rollouts.get_attempt("r1.1")
    assert attempt.status is AttemptStatus.FAILED
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.REQUEUING
    again = await store.queue.dequeue_rollout("w2")
    assert again is not None and again.attempt.attempt_id == "r1.2"
    assert await _finished(store) == []


async def test_released_attempts_leave_max_attempts_to_the_agent(store: RedisStore) -> None:
    """Two hand-backs then a failure of the agent's: max_attempts=2 still retries once, then fails."""
    await _claim(store, config=RolloutConfig(max_attempts=2, retry_condition=("failed",)))
    assert await store.rollouts.release_attempt("r1", "r1.1", reason="runner w1 stopped")
    assert (await store.queue.dequeue_rollout("w2")).attempt.attempt_id == "r1.2"
    assert await store.rollouts.release_attempt("r1", "r1.2", reason={"type": "ProxyUnreachable", "message": "x"})
    assert (await store.queue.dequeue_rollout("w3")).attempt.attempt_id == "r1.3"
    assert await store.rollouts.update_attempt("r1", "r1.3", status="failed", error="agent") == "requeued"
    assert (await store.queue.dequeue_rollout("w4")).attempt.attempt_id == "r1.4"
    assert await store.rollouts.update_attempt("r1", "r1.4", status="failed", error="agent") == "failed"
    assert (await store.rollouts.get_attempt("r1.2")).error["type"] == "ProxyUnreachable"


async def test_release_of_a_replaced_attempt_changes_nothing(store: RedisStore) -> None:
    """Releasing an attempt that is no longer the latest leaves the newer attempt running."""
    await _claim(store)
    await store.rollouts.update_rollout("r1", status="requeuing")
    newer = await store.queue.dequeue_rollout("w2")
    assert newer is not None and newer.attempt.attempt_id == "r1.2"
    assert await store.rollouts.release_attempt("r1", "r1.1") is False
    assert (await store.rollouts.get_attempt("r1.2")).status is AttemptStatus.PREPARING
    assert (await store.statistics())["queue_depth"] == 0


async def test_update_rollout_requeuing_of_waiting_rollout_changes_nothing(store: RedisStore) -> None:
    """Requeuing a rollout that is already waiting returns None and adds no queue entry."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1")
    assert await store.rollouts.update_rollout("r1", status="requeuing") is None
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.QUEUING
    assert await store.redis.xlen(store.keys.queue) == 1
    assert len(await store.queue.dequeue_rollouts("w1", count=5)) == 1


async def test_update_rollout_metadata(store: RedisStore) -> None:
    """Metadata of a rollout can be replaced without a status change."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", metadata={"a": 1})
    assert await store.rollouts.update_rollout("r1", metadata={"b": 2}) is None
    rollout = await store.rollouts.get_rollout("r1")
    assert (rollout.metadata, rollout.status) == ({"b": 2}, RolloutStatus.QUEUING)


async def test_cancel_queued_rollout(store: RedisStore) -> None:
    """A cancelled queued rollout is never claimed; its stale queue entry is acked."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1")
    assert await store.rollouts.cancel_rollout("r1") is True
    rollout = await store.rollouts.get_rollout("r1")
    assert rollout.status is RolloutStatus.CANCELLED and rollout.end_time is not None
    assert await store.queue.dequeue_rollouts("w1", count=5) == []
    assert await _pending(store) == 0
    assert (await store.rollouts.get_rollout("r1")).attempt_count == 0
    assert [(c.rollout_id, c.status, c.attempt_id) for c in await _finished(store)] == [
        ("r1", RolloutStatus.CANCELLED, None)
    ]


async def test_cancel_running_rollout(store: RedisStore) -> None:
    """Cancelling a running rollout fails its attempt and appends one finished entry, once."""
    await _claim(store)
    await store.spans.heartbeat("r1", "r1.1")
    assert await store.rollouts.cancel_rollout("r1", reason="user asked") is True
    attempt = await store.rollouts.get_attempt("r1.1")
    assert attempt.status is AttemptStatus.FAILED and attempt.end_time is not None
    assert attempt.error == {"type": "Error", "message": "user asked"}
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.CANCELLED
    assert await store.spans.heartbeat("r1", "r1.1") == (RolloutStatus.CANCELLED, AttemptStatus.FAILED)
    assert await store.rollouts.cancel_rollout("r1") is False
    assert [(c.rollout_id, c.status) for c in await _finished(store)] == [("r1", RolloutStatus.CANCELLED)]
    assert (await store.statistics())["heartbeat_watched"] == 0


async def test_cancel_finished_rollout_returns_false(store: RedisStore) -> None:
    """Cancelling a succeeded rollout changes nothing."""
    await _claim(store)
    await store.rollouts.update_attempt("r1", "r1.1", status="succeeded")
    assert await store.rollouts.cancel_rollout("r1") is False
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.SUCCEEDED
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.SUCCEEDED
    assert len(await _finished(store)) == 1


# --- idempotence and reports that change nothing ------------------------------------------------


async def test_enqueue_same_id_twice_changes_nothing(store: RedisStore) -> None:
    """A second enqueue of an existing id returns the original rollout and queues nothing."""
    first = await store.rollouts.enqueue_rollout({"v": 1}, rollout_id="r1", metadata={"m": 1})
    second = await store.rollouts.enqueue_rollout({"v": 2}, rollout_id="r1", metadata={"m": 2}, mode="test")
    assert second == first
    assert second.input == {"v": 1} and second.metadata == {"m": 1} and second.mode is None
    assert await store.redis.xlen(store.keys.queue) == 1
    assert await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout({"v": 3}, rollout_id="r1")]) == [False]
    claimed = await store.queue.dequeue_rollouts("w1", count=5)
    assert [c.rollout.input for c in claimed] == [{"v": 1}]
    await store.rollouts.enqueue_rollout({"v": 4}, rollout_id="r1")  # while preparing: not queued again
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.PREPARING
    assert await store.queue.dequeue_rollouts("w2", count=5) == []


async def test_enqueue_rollouts_reports_per_rollout(store: RedisStore) -> None:
    """enqueue_rollouts returns True for each new id and False for each existing one."""
    await store.rollouts.enqueue_rollout("old", rollout_id="b")
    batch = [store.rollouts.new_rollout(x, rollout_id=x) for x in ["a", "b", "c"]]
    assert await store.rollouts.enqueue_rollouts(batch) == [True, False, True]
    assert [c.rollout.rollout_id for c in await store.queue.dequeue_rollouts("w", count=10)] == ["b", "a", "c"]


async def test_report_on_superseded_attempt(store: RedisStore) -> None:
    """A report from the worker of a superseded attempt returns 'superseded' and changes nothing."""
    await _claim(store)
    await store.rollouts.start_attempt("r1", "w2")
    assert await store.rollouts.update_attempt("r1", "r1.1", status="succeeded") == "superseded"
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.FAILED
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.PREPARING
    assert (await store.rollouts.get_attempt("r1.2")).status is AttemptStatus.PREPARING
    assert await _finished(store) == []


async def test_duplicate_report_returns_already(store: RedisStore) -> None:
    """A second report on an ended attempt returns 'already' and changes nothing."""
    await _claim(store)
    assert await store.rollouts.update_attempt("r1", "r1.1", status="succeeded") == "succeeded"
    assert await store.rollouts.update_attempt("r1", "r1.1", status="succeeded") == "already"
    assert await store.rollouts.update_attempt("r1", "r1.1", status="failed") == "already"
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.SUCCEEDED
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.SUCCEEDED
    assert len(await _finished(store)) == 1


async def test_report_after_cancel_is_ignored(store: RedisStore) -> None:
    """A report arriving after the rollout was cancelled returns 'ignored' and changes nothing."""
    await _claim(store)
    await store.rollouts.cancel_rollout("r1")
    assert await store.rollouts.update_attempt("r1", "r1.1", status="succeeded") == "ignored"
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.CANCELLED
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.FAILED
    assert [c.status for c in await _finished(store)] == [RolloutStatus.CANCELLED]


# --- errors -------------------------------------------------------------------------------------


async def test_unknown_rollout_and_attempt_raise_not_found(store: RedisStore) -> None:
    """Reads and writes of an unknown rollout or attempt raise NotFound naming it."""
    with pytest.raises(NotFound, match=f"rollout nope does not exist in experiment {store.experiment}"):
        await store.rollouts.get_rollout("nope")
    with pytest.raises(NotFound, match=r"attempt nope\.1 does not exist"):
        await store.rollouts.get_attempt("nope.1")
    with pytest.raises(NotFound, match="rollout nope does not exist"):
        await store.rollouts.update_rollout("nope", status="cancelled")
    with pytest.raises(NotFound, match="rollout nope does not exist"):
        await store.rollouts.update_rollout("nope", metadata={"a": 1})
    with pytest.raises(NotFound, match="rollout nope does not exist"):
        await store.rollouts.cancel_rollout("nope")
    with pytest.raises(NotFound, match=r"attempt nope\.1 of rollout nope does not exist"):
        await store.rollouts.update_attempt("nope", "nope.1", status="succeeded")
    with pytest.raises(NotFound, match=r"attempt nope\.1 does not exist"):
        await store.rollouts.update_attempt("nope", "nope.1", worker_id="w")
    with pytest.raises(NotFound, match="rollout nope does not exist"):
        await store.rollouts.query_attempts("nope")
    assert await store.rollouts.get_rollouts(["nope"]) == [None]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rollout_id": "bad id!"}, "rollout_id 'bad id!' is invalid"),
        ({"rollout_id": "x" * 129}, "is invalid: use 1-128"),
        ({"resources_id": "a/b"}, "resources_id 'a/b' is invalid"),
        ({"mode": "prod"}, "mode 'prod' unknown; use train, val or test"),
        ({"config": {"retries": 3}}, r"unknown rollout config keys \['retries'\]"),
        ({"config": {"max_attempts": 0}}, "max_attempts must be an integer >= 1, got 0"),
        ({"config": {"max_attempts": 1.5}}, "max_attempts must be an integer >= 1, got 1.5"),
        ({"config": {"timeout_seconds": -1}}, "timeout_seconds must be a positive number"),
        ({"config": {"unresponsive_seconds": float("nan")}}, "unresponsive_seconds must be a positive"),
        ({"config": {"retry_condition": ["succeeded"]}}, r"retry_condition \['succeeded'\] unknown"),
    ],
)
async def test_invalid_rollout_input_is_refused(store: RedisStore, kwargs: dict, message: str) -> None:
    """Bad ids, modes and config values raise InvalidInput with a clear message; nothing is stored."""
    with pytest.raises(InvalidInput, match=message):
        await store.rollouts.enqueue_rollout("x", **kwargs)
    assert (await store.statistics())["total_rollouts"] == 0
    assert await store.redis.xlen(store.keys.queue) == 0


async def test_invalid_status_updates_are_refused(store: RedisStore) -> None:
    """Unknown statuses are InvalidInput; preparing, running and queuing cannot be forced."""
    await _claim(store)
    with pytest.raises(InvalidTransition, match="cannot go back to preparing"):
        await store.rollouts.update_attempt("r1", "r1.1", status="preparing")
    with pytest.raises(InvalidInput, match="attempt status 'done' unknown"):
        await store.rollouts.update_attempt("r1", "r1.1", status="done")
    for status in ["preparing", "running", "queuing"]:
        with pytest.raises(InvalidTransition, match=f"not {status}"):
            await store.rollouts.update_rollout("r1", status=status)
    with pytest.raises(InvalidInput, match="rollout status 'done' unknown"):
        await store.rollouts.update_rollout("r1", status="done")
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.PREPARING
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.PREPARING


async def test_query_attempts_filters_and_paginates(store: RedisStore) -> None:
    """Attempts filter by status and worker, and page in either order."""
    await store.rollouts.enqueue_rollout(
        "x", rollout_id="r", config={"max_attempts": 3, "retry_condition": ["failed"]}
    )
    for worker in ("w1", "w2", "w1"):
        [claimed] = await store.queue.dequeue_rollouts(worker, 1)
        await store.rollouts.update_attempt("r", claimed.attempt.attempt_id, status="failed")
    ids = lambda attempts: [a.attempt_id for a in attempts]  # noqa: E731
    assert ids(await store.rollouts.query_attempts("r")) == ["r.1", "r.2", "r.3"]
    assert ids(await store.rollouts.query_attempts("r", worker_id="w1")) == ["r.1", "r.3"]
    assert ids(await store.rollouts.query_attempts("r", status="succeeded")) == []
    assert ids(await store.rollouts.query_attempts("r", descending=True, limit=2)) == ["r.3", "r.2"]
    assert ids(await store.rollouts.query_attempts("r", offset=1, limit=1)) == ["r.2"]


async def test_query_workers_filters_sorts_and_paginates(store: RedisStore) -> None:
    """Workers filter by status and page by id or by last heartbeat."""
    for worker, status in (("b", "busy"), ("a", "idle"), ("c", "busy")):
        await store.registry.update_worker(worker, status)
    assert [w.worker_id for w in await store.registry.query_workers()] == ["a", "b", "c"]
    assert [w.worker_id for w in await store.registry.query_workers("busy")] == ["b", "c"]
    newest = await store.registry.query_workers(sort_by="last_heartbeat_time", descending=True, limit=1)
    assert [w.worker_id for w in newest] == ["c"]
    assert [w.worker_id for w in await store.registry.query_workers(offset=2)] == ["c"]


async def test_reward_is_stored_with_the_attempt_and_the_rollout_it_ends(store: RedisStore) -> None:
    """A reported reward is kept on the attempt; on the rollout only when that attempt ends it."""
    config = {"max_attempts": 2, "retry_condition": ["failed"]}
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", config=config)
    first = await store.queue.dequeue_rollout("w")
    assert first is not None and first.rollout.reward is None and first.attempt.reward is None
    assert await store.rollouts.update_attempt("r1", "r1.1", status="failed", reward=0.25) == "requeued"
    assert (await store.rollouts.get_attempt("r1.1")).reward == 0.25
    assert (await store.rollouts.get_rollout("r1")).reward is None  # the rollout goes on: not its reward
    assert await store.queue.dequeue_rollout("w") is not None
    assert await store.rollouts.update_attempt("r1", "r1.2", status="succeeded", reward=0.75) == "succeeded"
    assert (await store.rollouts.get_attempt("r1.2")).reward == 0.75
    assert (await store.rollouts.get_rollout("r1")).reward == 0.75
    (row,) = await store.samples.read_for_samples(["r1"])
    assert row is not None and row.reward == 0.75
