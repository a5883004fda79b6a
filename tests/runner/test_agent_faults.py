"""Agents cannot take the runner down: whatever an agent raises or returns ends its attempt only."""

from __future__ import annotations

import asyncio
import os

import fault_agents
import pytest

from fulmen.records import RolloutConfig
from fulmen.records.status import AttemptStatus, RolloutStatus
from fulmen.sdk.agent import load_agent


def _agent(name: str):
    return load_agent(f"fault_agents:{name}")


@pytest.mark.parametrize("agent", ["raises_base", "sync_raises_base"])
@pytest.mark.parametrize("kind", ["KeyboardInterrupt", "SystemExit", "GeneratorExit", "BaseException"])
async def test_base_exception_of_an_agent_fails_its_attempt_and_the_runner_goes_on(
    real_store, start_runner, agent, kind
) -> None:
    """An agent raising KeyboardInterrupt/SystemExit/GeneratorExit fails its attempt, saying what it raised."""
    ids = [(await real_store.rollouts.enqueue_rollout({"raise": kind})).rollout_id for _ in range(2)]
    runner = await start_runner(_agent(agent), concurrency=1)
    done = await real_store.finished.wait_for_rollouts(ids, timeout_s=20)
    assert len(done) == 2  # both reported at once, one after the other: the runner went on
    for rid in ids:
        assert (await real_store.rollouts.get_rollout(rid)).status is RolloutStatus.FAILED
        (attempt,) = await real_store.rollouts.query_attempts(rid)
        assert attempt.status is AttemptStatus.FAILED
        assert attempt.error is not None and f"the agent raised {kind}" in attempt.error["message"]
    assert not runner.stopping.is_set() and runner.failed == 0 and runner.finished == 2


@pytest.mark.parametrize("agent", ["raises_base", "sync_raises_base"])
async def test_cancelled_error_of_an_agent_fails_the_attempt_and_counts(real_store, start_runner, agent) -> None:
    """An agent raising CancelledError itself fails its attempt (counted, retried as configured), never requeued."""
    config = RolloutConfig(max_attempts=2, retry_condition=("failed",))
    r = await real_store.rollouts.enqueue_rollout({"raise": "CancelledError"}, config=config)
    await start_runner(_agent(agent))
    assert await real_store.finished.wait_for_rollouts([r.rollout_id], timeout_s=20)
    assert (await real_store.rollouts.get_rollout(r.rollout_id)).status is RolloutStatus.FAILED
    attempts = await real_store.rollouts.query_attempts(r.rollout_id)
    assert [a.status for a in attempts] == [AttemptStatus.FAILED, AttemptStatus.FAILED]
    assert all("the agent raised CancelledError" in (a.error or {}).get("message", "") for a in attempts)


@pytest.mark.parametrize("named", [False, True])
async def test_unencodable_reward_fails_the_attempt_at_once(real_store, start_runner, named) -> None:
    """A reward of 10**400 (no float holds it) fails the attempt with a clear reason, not via the watchdog."""
    r = await real_store.rollouts.enqueue_rollout({"named": named})
    runner = await start_runner(_agent("huge_reward"))
    assert await real_store.finished.wait_for_rollouts([r.rollout_id], timeout_s=10)
    (attempt,) = await real_store.rollouts.query_attempts(r.rollout_id)
    assert attempt.status is AttemptStatus.FAILED
    assert attempt.error is not None and "too large for a float" in attempt.error["message"]
    assert runner.failed == 0


async def test_hung_sync_agents_hold_only_the_runners_own_bounded_pool(real_store, start_runner) -> None:
    """Timed-out sync agents keep threads of the runner's pool (counted), never of the default executor."""
    from fulmen_runner.agent_threads import THREAD_NAME_PREFIX
    from fulmen_runner.main import AgentThreadGauges, runner_counters

    hung = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor size: enough to exhaust it
    config = RolloutConfig(timeout_seconds=0.3, max_attempts=1)
    ids = [(await real_store.rollouts.enqueue_rollout({"i": i}, config=config)).rollout_id for i in range(hung)]
    fault_agents.RELEASE.clear()
    fault_agents.THREAD_NAMES.clear()
    runner = await start_runner(_agent("sync_hangs"), concurrency=hung)
    try:
        assert len(await real_store.finished.wait_for_rollouts(ids, timeout_s=30)) == hung
        for rid in ids:
            assert [a.status for a in await real_store.rollouts.query_attempts(rid)] == [AttemptStatus.TIMEOUT]
        assert runner.threads.size == 2 * hung  # bounded, by the runner's concurrency
        assert runner.threads.hung == hung and runner.threads.abandoned == hung
        assert all(name.startswith(THREAD_NAME_PREFIX) for name in fault_agents.THREAD_NAMES)
        # the default executor still has every thread free
        loop = asyncio.get_running_loop()
        assert await asyncio.wait_for(loop.run_in_executor(None, lambda: "free"), timeout=10) == "free"
        # and /metrics says how many threads are hung
        counters = {c.name: c.value for c in runner_counters(runner)}
        assert counters["fulmen_runner_agent_threads_abandoned"] == hung
        gauges = {m.name: m.samples[0].value for m in AgentThreadGauges(runner).collect()}
        assert gauges["fulmen_runner_agent_threads_hung"] == hung
    finally:
        fault_agents.RELEASE.set()
    for _ in range(200):
        if runner.threads.hung == 0:
            break
        await asyncio.sleep(0.02)
    assert runner.threads.hung == 0 and runner.threads.running == 0
