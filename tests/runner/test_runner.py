"""The runner in this process against a real Redis: outcomes, spans, retries, timeouts, hooks, stop."""

from __future__ import annotations

import asyncio

import runner_test_agents as agents

from fulmen.records import RolloutConfig
from fulmen.records.status import AttemptStatus, RolloutStatus
from fulmen.store import RedisStore
from fulmen.telemetry import semconv


async def _finish(store: RedisStore, ids: list[str], timeout_s: float = 20.0) -> None:
    done = await store.finished.wait_for_rollouts(ids, timeout_s=timeout_s)
    assert len(done) == len(ids), f"only {len(done)} of {len(ids)} rollouts finished"


async def test_succeeded_rollouts_have_their_spans_in_order_reward_last(real_store, start_runner) -> None:
    """Every rollout succeeds; its spans are stored in sequence order, bound to it, the reward last."""
    ids = [(await real_store.rollouts.enqueue_rollout({"i": i})).rollout_id for i in range(20)]
    await start_runner("noop", concurrency=8)
    await _finish(real_store, ids)
    for rid in ids:
        rollout = await real_store.rollouts.get_rollout(rid)
        assert rollout.status is RolloutStatus.SUCCEEDED
        spans = await real_store.spans.query_spans(rid)
        assert [s.sequence_id for s in spans] == list(range(1, len(spans) + 1))
        names = [s.name for s in spans]
        assert names == ["fulmen.message"] * 7 + ["fulmen.rollout", "fulmen.reward"]
        assert spans[-1].attributes[semconv.REWARD] == 1.0
        assert {s.attempt_id for s in spans} == {rollout.attempt_id}
        assert {s.attributes[semconv.ROLLOUT_ID] for s in spans} == {rid}
        root = spans[-2]
        assert all(s.parent_id == root.span_id for s in spans if s is not root)
        assert len({s.trace_id for s in spans}) == 1


async def test_sync_agent_runs_in_a_thread_with_its_spans_bound(real_store, start_runner) -> None:
    """A sync agent's spans (emitted from a worker thread) belong to its attempt; its reward is stored."""
    r = await real_store.rollouts.enqueue_rollout({"reward": 0.75})
    await start_runner("sync_agent")
    await _finish(real_store, [r.rollout_id])
    spans = await real_store.spans.query_spans(r.rollout_id)
    assert [s.name for s in spans] == ["fulmen.object", "fulmen.rollout", "fulmen.reward"]
    assert spans[0].attributes[semconv.OBJECT_JSON] == f'{{"rollout": "{r.rollout_id}", "task": {{"reward": 0.75}}}}'
    assert spans[-1].attributes[semconv.REWARD] == 0.75
    # the runner stores the final reward with the attempt and the rollout it ended
    rollout = await real_store.rollouts.get_rollout(r.rollout_id)
    assert rollout.reward == 0.75
    assert (await real_store.rollouts.get_attempt(rollout.attempt_id or "")).reward == 0.75


async def test_agent_that_raises_fails_with_exception_span_and_is_retried(real_store, start_runner) -> None:
    """An exception fails the attempt, is stored as a span, and the rollout is retried as configured."""
    config = RolloutConfig(max_attempts=2, retry_condition=("failed",))
    r = await real_store.rollouts.enqueue_rollout("x", config=config)
    await start_runner("raises")
    await _finish(real_store, [r.rollout_id])
    rollout = await real_store.rollouts.get_rollout(r.rollout_id)
    assert rollout.status is RolloutStatus.FAILED
    attempts = await real_store.rollouts.query_attempts(r.rollout_id)
    assert [a.status for a in attempts] == [AttemptStatus.FAILED, AttemptStatus.FAILED]
    assert rollout.reward is None and [a.reward for a in attempts] == [None, None]
    assert attempts[0].error is not None and "bad task 'x'" in attempts[0].error["message"]
    spans = await real_store.spans.query_spans(r.rollout_id, attempts[0].attempt_id)
    exc = [s for s in spans if s.name == semconv.EXCEPTION_SPAN]
    assert len(exc) == 1
    assert exc[0].attributes[semconv.EXCEPTION_TYPE] == "ValueError"
    assert "bad task" in exc[0].attributes[semconv.EXCEPTION_STACKTRACE]
    assert exc[0].status_code == "ERROR"


async def test_retry_succeeds_on_second_attempt(real_store, start_runner) -> None:
    """A rollout whose first attempt fails succeeds on its retry."""
    r = await real_store.rollouts.enqueue_rollout("x", config=RolloutConfig(max_attempts=3, retry_condition=("failed",)))
    await start_runner("flaky")
    await _finish(real_store, [r.rollout_id])
    assert (await real_store.rollouts.get_rollout(r.rollout_id)).status is RolloutStatus.SUCCEEDED
    assert [a.status for a in await real_store.rollouts.query_attempts(r.rollout_id)] == [
        AttemptStatus.FAILED,
        AttemptStatus.SUCCEEDED,
    ]


async def test_agent_that_hangs_times_out_and_is_retried(real_store, start_runner) -> None:
    """A hanging agent is stopped at timeout_seconds: attempt timeout, retried, then failed."""
    config = RolloutConfig(timeout_seconds=0.3, max_attempts=2, retry_condition=("timeout",))
    r = await real_store.rollouts.enqueue_rollout("x", config=config)
    await start_runner("hangs")
    await _finish(real_store, [r.rollout_id])
    attempts = await real_store.rollouts.query_attempts(r.rollout_id)
    assert [a.status for a in attempts] == [AttemptStatus.TIMEOUT, AttemptStatus.TIMEOUT]
    assert (await real_store.rollouts.get_rollout(r.rollout_id)).status is RolloutStatus.FAILED


async def test_nan_reward_fails_the_attempt_with_a_clear_error(real_store, start_runner) -> None:
    """A NaN reward is refused: the attempt fails saying why, and no reward span is stored."""
    r = await real_store.rollouts.enqueue_rollout("x")
    await start_runner("nan_reward")
    await _finish(real_store, [r.rollout_id])
    attempt = (await real_store.rollouts.query_attempts(r.rollout_id))[0]
    assert attempt.status is AttemptStatus.FAILED
    assert attempt.error is not None and "finite" in attempt.error["message"]
    assert not await real_store.spans.query_spans(r.rollout_id, name=semconv.REWARD_SPAN)


async def test_agent_returning_text_fails_with_what_to_return(real_store, start_runner) -> None:
    """A result that is no reward fails the attempt with a message that says what to return."""
    r = await real_store.rollouts.enqueue_rollout("x")
    await start_runner("returns_text")
    await _finish(real_store, [r.rollout_id])
    attempt = (await real_store.rollouts.query_attempts(r.rollout_id))[0]
    assert attempt.status is AttemptStatus.FAILED
    assert attempt.error is not None and "return a float reward" in attempt.error["message"]


async def test_named_rewards_keep_the_primary(real_store, start_runner) -> None:
    """emit_reward with named values stores them all and marks the primary one."""
    r = await real_store.rollouts.enqueue_rollout("x")
    await start_runner("named_rewards")
    await _finish(real_store, [r.rollout_id])
    assert (await real_store.rollouts.get_rollout(r.rollout_id)).status is RolloutStatus.SUCCEEDED
    (reward,) = await real_store.spans.query_spans(r.rollout_id, name=semconv.REWARD_SPAN)
    assert reward.attributes[semconv.REWARD] == 0.0
    assert reward.attributes[semconv.REWARD_PRIMARY] == "correct"
    assert reward.attributes[semconv.REWARD_PREFIX + "format"] == 1.0
    # emitted by the agent itself (it returned None): the runner finds it among the attempt's spans
    assert (await real_store.rollouts.get_rollout(r.rollout_id)).reward == 0.0


async def test_operations_record_input_and_output(real_store, start_runner) -> None:
    """fulmen.operation as decorator and context manager records a span with input and output."""
    r = await real_store.rollouts.enqueue_rollout("x")
    await start_runner("with_operation")
    await _finish(real_store, [r.rollout_id])
    spans = {s.name: s for s in await real_store.spans.query_spans(r.rollout_id)}
    add = next(s for n, s in spans.items() if n.endswith("add"))
    assert add.attributes[semconv.OPERATION_INPUT] == '{"args": [1, 2], "kwargs": {}}'
    assert add.attributes[semconv.OPERATION_OUTPUT] == "3"
    assert spans["lookup"].attributes[semconv.OPERATION_OUTPUT] == '{"hits": 3}'
    assert spans[semconv.REWARD_SPAN].attributes[semconv.REWARD] == 3.0


async def test_class_agent_hooks_run_in_order(real_store, start_runner) -> None:
    """A class agent's hooks run around its rollout, in order, with the reward at the end."""
    agent = agents.ClassAgent()
    r = await real_store.rollouts.enqueue_rollout("x")
    await start_runner(agent)
    await _finish(real_store, [r.rollout_id])
    assert agent.calls == [
        "on_rollout_start",
        "on_trace_start",
        "rollout",
        "on_trace_end",
        "on_rollout_end:0.25",
    ]


async def test_cancelled_rollout_stops_its_agent(real_store, start_runner, monkeypatch) -> None:
    """Cancelling a running rollout stops the agent at the next heartbeat; nothing is reported over it."""
    monkeypatch.setattr("fulmen_runner.heartbeats.HEARTBEAT_MAX_S", 0.1)
    r = await real_store.rollouts.enqueue_rollout("x")
    runner = await start_runner("hangs")
    for _ in range(100):
        if runner.running:
            break
        await asyncio.sleep(0.02)
    assert await real_store.rollouts.cancel_rollout(r.rollout_id)
    for _ in range(100):
        if not runner.running:
            break
        await asyncio.sleep(0.02)
    assert not runner.running
    assert (await real_store.rollouts.get_rollout(r.rollout_id)).status is RolloutStatus.CANCELLED


async def test_stop_lets_short_work_finish_and_hands_back_the_rest(real_store, start_runner) -> None:
    """On stop, attempts that end within the grace period succeed; the others go back to the queue."""
    quick = await real_store.rollouts.enqueue_rollout({"sleep_s": 0.2})
    long = await real_store.rollouts.enqueue_rollout({"sleep_s": 30})
    runner = await start_runner("slow", concurrency=2, grace_s=1.0)
    for _ in range(200):
        if len(runner.running) == 2:
            break
        await asyncio.sleep(0.02)
    runner.stop()
    for _ in range(300):
        if not runner.running:
            break
        await asyncio.sleep(0.02)
    assert (await real_store.rollouts.get_rollout(quick.rollout_id)).status is RolloutStatus.SUCCEEDED
    handed_back = await real_store.rollouts.get_rollout(long.rollout_id)
    assert handed_back.status is RolloutStatus.REQUEUING
    (attempt,) = await real_store.rollouts.query_attempts(long.rollout_id)
    assert attempt.status is AttemptStatus.FAILED
    assert "stopped" in (attempt.error or {}).get("message", "")
    assert await real_store.spans.query_spans(long.rollout_id, name="fulmen.message")  # its spans were kept
    assert (await real_store.statistics())["queue_depth"] == 1
    worker = (await real_store.registry.query_workers())[0]
    assert worker.status == "stopped"

