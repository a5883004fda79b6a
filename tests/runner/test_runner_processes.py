"""`fulmen runner` and `fulmen run-once` as real processes on a real Redis: scale-out, SIGKILL, SIGTERM,
bad agents, and the debugging command."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest
from runner_processes import (
    FulmenProcess,
    FulmenProcesses,
    child_env,
    wait_until_ready,
    worker_id_of,
)

from fulmen.records import RolloutConfig
from fulmen.records.status import AttemptStatus, RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import free_port
from fulmen.telemetry import semconv

pytestmark = pytest.mark.slow






async def _finish(store: RedisStore, ids: list[str], timeout_s: float = 120.0) -> None:
    done = await store.finished.wait_for_rollouts(ids, timeout_s=timeout_s)
    assert len(done) == len(ids), f"only {len(done)} of {len(ids)} rollouts finished"


async def _wait_for_spans(store: RedisStore, ids: list[str], name: str, timeout_s: float = 120.0) -> None:
    """Return once every rollout has stored a span named ``name`` (its agent has started)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        found = [bool(await store.spans.query_spans(rid, name=name)) for rid in ids]
        if all(found):
            return
        assert asyncio.get_running_loop().time() < deadline, f"{found.count(False)} rollout(s) never started"
        await asyncio.sleep(0.05)


def _pid_of(spans: list) -> int:
    """The pid that `runner_test_agents.pid_agent` recorded in its first span."""
    (message,) = [s.attributes[semconv.MESSAGE] for s in spans if s.name == semconv.MESSAGE_SPAN]
    return int(message.removeprefix("pid "))


def _one_line(text: str) -> str:
    return " ".join(text.split())


# --- scale-out --------------------------------------------------------------------------------------


async def test_200_rollouts_through_4_runner_processes_all_succeed(real_store, procs) -> None:
    """200 rollouts through 4 runner processes all succeed, spans in sequence order, reward last, spread."""
    runners = [await procs.runner("runner_test_agents:noop", "--concurrency", "8") for _ in range(4)]
    await wait_until_ready(real_store, *runners)
    rollouts = [real_store.rollouts.new_rollout({"i": i}) for i in range(200)]
    assert all(await real_store.rollouts.enqueue_rollouts(rollouts))
    ids = [r.rollout_id for r in rollouts]
    await _finish(real_store, ids)

    workers = set()
    for rollout in await real_store.rollouts.get_rollouts(ids):
        assert rollout is not None and rollout.status is RolloutStatus.SUCCEEDED
        (attempt,) = await real_store.rollouts.query_attempts(rollout.rollout_id)
        assert attempt.status is AttemptStatus.SUCCEEDED
        workers.add(attempt.worker_id)
        spans = await real_store.spans.query_spans(rollout.rollout_id)
        assert [s.sequence_id for s in spans] == list(range(1, len(spans) + 1))
        assert [s.name for s in spans] == [semconv.MESSAGE_SPAN] * 7 + [semconv.ROLLOUT_SPAN, semconv.REWARD_SPAN]
        assert spans[-1].attributes[semconv.REWARD] == 1.0
        assert {s.attempt_id for s in spans} == {attempt.attempt_id}
    runner_ids = {worker_id_of(await real_store.registry.query_workers(), r.pid) for r in runners}
    assert workers <= runner_ids
    assert len(workers) > 1, "one runner took every rollout"


# --- crashes and stops ------------------------------------------------------------------------------


async def test_rollout_of_a_sigkilled_runner_completes_on_another(real_store, procs) -> None:
    """A runner SIGKILLed mid-rollout: the watchdog marks its attempts unresponsive, another runner completes them."""
    doomed = await procs.runner("runner_test_agents:pid_agent", "--concurrency", "8")
    await procs.start("watchdog", "--interval-s", "0.2")
    await wait_until_ready(real_store, doomed)
    config = RolloutConfig(unresponsive_seconds=1.5, max_attempts=2, retry_condition=("unresponsive",))
    ids = [(await real_store.rollouts.enqueue_rollout({"sleep_s": 2.0}, config=config)).rollout_id for _ in range(3)]
    await _wait_for_spans(real_store, ids, semconv.MESSAGE_SPAN)  # every agent is running on `doomed`
    doomed.signal(signal.SIGKILL)
    assert await doomed.wait() == -signal.SIGKILL
    survivor = await procs.runner("runner_test_agents:pid_agent", "--concurrency", "8")
    await _finish(real_store, ids)

    for rid in ids:
        assert (await real_store.rollouts.get_rollout(rid)).status is RolloutStatus.SUCCEEDED
        first, second = await real_store.rollouts.query_attempts(rid)
        assert first.status is AttemptStatus.UNRESPONSIVE
        assert second.status is AttemptStatus.SUCCEEDED
        assert _pid_of(await real_store.spans.query_spans(rid, first.attempt_id)) == doomed.pid
        assert _pid_of(await real_store.spans.query_spans(rid, second.attempt_id)) == survivor.pid
        spans = await real_store.spans.query_spans(rid, second.attempt_id)
        assert spans[-1].name == semconv.REWARD_SPAN


async def test_sigterm_finishes_or_hands_back_in_flight_rollouts(real_store, procs) -> None:
    """SIGTERM: the runner exits 0, short rollouts finish, long ones are requeued (none stuck); another runner completes them."""
    first = await procs.runner("runner_test_agents:slow", "--concurrency", "4", "--grace-s", "0.5")
    await wait_until_ready(real_store, first)
    short = [(await real_store.rollouts.enqueue_rollout({"sleep_s": 0.2})).rollout_id for _ in range(2)]
    long = [(await real_store.rollouts.enqueue_rollout({"sleep_s": 3.0})).rollout_id for _ in range(2)]
    await _wait_for_spans(real_store, short + long, semconv.MESSAGE_SPAN)
    first.signal(signal.SIGTERM)
    assert await first.wait(timeout_s=10.0) == 0, first.stderr

    statuses = {r.rollout_id: r.status for r in await real_store.rollouts.get_rollouts(short + long) if r}
    assert set(statuses.values()) <= {RolloutStatus.SUCCEEDED, RolloutStatus.REQUEUING}, statuses
    assert [statuses[rid] for rid in short] == [RolloutStatus.SUCCEEDED] * 2
    assert [statuses[rid] for rid in long] == [RolloutStatus.REQUEUING] * 2
    for rid in long:
        (attempt,) = await real_store.rollouts.query_attempts(rid)
        assert attempt.status is AttemptStatus.FAILED
        assert "stopped" in (attempt.error or {}).get("message", "")
        names = {s.name for s in await real_store.spans.query_spans(rid, attempt.attempt_id)}
        assert {semconv.MESSAGE_SPAN, semconv.ROLLOUT_SPAN} <= names  # what it traced was flushed
    (worker,) = await real_store.registry.query_workers()
    assert worker.status == "stopped"

    second = await procs.runner("runner_test_agents:slow", "--concurrency", "4")
    await _finish(real_store, long)
    for rid in long:
        assert (await real_store.rollouts.get_rollout(rid)).status is RolloutStatus.SUCCEEDED
        handed_back, completed = await real_store.rollouts.query_attempts(rid)
        assert completed.status is AttemptStatus.SUCCEEDED
        assert completed.worker_id == worker_id_of(await real_store.registry.query_workers(), second.pid)
        assert handed_back.worker_id == worker.worker_id


async def test_sigterm_with_a_sync_agent_still_running_hands_back_and_exits(real_store, procs) -> None:
    """SIGTERM while a sync agent sleeps in its thread: the runner hands the attempt back and exits 0 at once."""
    runner = await procs.runner("runner_test_agents:sync_sleeps", "--grace-s", "0.5")
    await wait_until_ready(real_store, runner)
    rid = (await real_store.rollouts.enqueue_rollout({"sleep_s": 60.0})).rollout_id
    await _wait_for_spans(real_store, [rid], semconv.MESSAGE_SPAN)  # the agent's thread is sleeping
    runner.signal(signal.SIGTERM)
    assert await runner.wait(timeout_s=10.0) == 0, runner.stderr  # long before the thread's 60 s are up
    assert (await real_store.rollouts.get_rollout(rid)).status is RolloutStatus.REQUEUING


# --- bad agents -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agent_args", "message"),
    [
        (["--agent", "nosuchmodule:x"], "cannot import module 'nosuchmodule'"),
        (["--agent", "runner_test_agents:missing"], "module 'runner_test_agents' has no 'missing'"),
        (["--agent", "runner_test_agents:wrong_signature"], "parameter 'client' unknown"),
        (["--agent", "runner_test_agents:NOT_AN_AGENT"], "NOT_AN_AGENT is not an agent but a int value"),
        (["--agent", "runner_test_agents"], "give it as module:function"),
        ([], "no agent: pass --agent module:function"),
    ],
    ids=["no-module", "no-attribute", "wrong-signature", "not-callable", "no-colon", "no-agent"],
)
async def test_bad_agent_fails_at_start_without_redis(procs, experiment, agent_args, message) -> None:
    """A wrong or missing --agent exits 2 with a message naming the problem, before connecting to Redis."""
    closed = f"redis://127.0.0.1:{free_port()}/0"
    runner = await procs.start("runner", *agent_args, env=child_env(closed, experiment))
    assert await runner.wait(timeout_s=30.0) == 2  # Redis would be waited for 60 s: it never was
    assert message in _one_line(runner.stderr)
    assert "Traceback" not in runner.stderr


# --- run-once ---------------------------------------------------------------------------------------


async def _run_once(procs: FulmenProcesses, *args: str) -> FulmenProcess:
    process = await procs.start("run-once", *args)
    await process.wait()
    return process


async def test_run_once_prints_spans_and_reward(real_store, procs) -> None:
    """run-once runs one task, prints every span and `reward: 1.0`, exits 0, and stores the rollout."""
    done = await _run_once(procs, "--agent", "runner_test_agents:noop", "--task", '{"x": 1}')
    assert done.process.returncode == 0, done.stderr
    out = done.stdout
    assert "9 span(s)" in out
    assert out.count(semconv.MESSAGE_SPAN) == 7
    assert "reward 1.0" in out  # the reward span's line
    assert "status: succeeded  reward: 1.0" in out
    (rollout,) = await real_store.rollouts.query_rollouts()
    assert rollout.rollout_id in out
    assert rollout.input == {"x": 1}
    assert rollout.status is RolloutStatus.SUCCEEDED


async def test_run_once_of_a_raising_agent_exits_1_with_the_exception(procs) -> None:
    """run-once of an agent that raises prints the exception (as a span and as the error) and exits 1."""
    done = await _run_once(procs, "--agent", "runner_test_agents:raises", "--task", '{"x": 1}')
    assert done.process.returncode == 1, done.stderr
    assert "status: failed" in done.stdout
    assert "error: ValueError: bad task {'x': 1}" in done.stdout
    assert f"{semconv.EXCEPTION_SPAN}" in done.stdout


async def test_run_once_json_is_parseable(real_store, procs) -> None:
    """run-once --json prints one JSON document with the status, the reward and the spans in order."""
    done = await _run_once(procs, "--agent", "runner_test_agents:noop", "--task", '{"x": 1}', "--json")
    assert done.process.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "succeeded"
    assert result["reward"] == 1.0
    assert result["error"] is None
    spans = result["spans"]
    assert [s["sequence_id"] for s in spans] == list(range(1, 10))
    assert spans[-1]["name"] == semconv.REWARD_SPAN
    assert spans[-1]["attributes"][semconv.REWARD] == 1.0
    assert {s["attributes"][semconv.ROLLOUT_ID] for s in spans} == {result["rollout_id"]}


async def test_run_once_with_malformed_task_exits_2(procs) -> None:
    """run-once with --task that is broken JSON exits 2 saying so, and runs nothing."""
    done = await _run_once(procs, "--agent", "runner_test_agents:noop", "--task", "{bad")
    assert done.process.returncode == 2
    assert "--task is not valid JSON" in _one_line(done.stderr)
    assert done.stdout == ""


async def test_run_once_prints_bracketed_agent_text_verbatim(procs) -> None:
    """Agent text with square brackets (chat templates) is printed as it is, not read as markup."""
    done = await _run_once(procs, "--agent", "runner_test_agents:bracket_text", "--task", '{"x": 1}')
    assert done.process.returncode == 0, done.stderr
    assert "[INST] What is 2 + 2? [/INST] 4" in done.stdout
    assert "status: succeeded  reward: 1.0" in done.stdout
