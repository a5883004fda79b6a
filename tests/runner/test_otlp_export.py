"""A runner process exports its spans over OTLP/HTTP: each rollout one trace, bound to its attempt."""

from __future__ import annotations

import asyncio
import signal
from collections import defaultdict
from collections.abc import Iterator

import pytest
from fakes.otlp_receiver import OtlpReceiver, ReceivedSpan
from runner_processes import FulmenProcesses, child_env, wait_until_ready

from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.telemetry.tracing import rollout_trace_id

pytestmark = pytest.mark.slow


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r






def _by_rollout(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    grouped: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for s in spans:
        grouped[s.attributes.get(semconv.ROLLOUT_ID, "")].append(s)
    return grouped


async def _run_and_stop(
    store: RedisStore, procs: FulmenProcesses, receiver: OtlpReceiver, agent: str, schedule_delay_ms: int
) -> list[str]:
    """Run 3 rollouts through one exporting runner, SIGTERM it; return the rollout ids."""
    env = child_env(
        procs.redis_url,
        procs.experiment,
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BSP_SCHEDULE_DELAY=str(schedule_delay_ms),
    )
    runner = await procs.runner(agent, env=env)
    await wait_until_ready(store, runner)
    ids = [(await store.rollouts.enqueue_rollout({"i": i})).rollout_id for i in range(3)]
    assert len(await store.finished.wait_for_rollouts(ids, timeout_s=120)) == 3
    runner.signal(signal.SIGTERM)
    assert await runner.wait(timeout_s=30) == 0, runner.stderr
    return ids


async def _assert_exported_as_stored(store: RedisStore, receiver: OtlpReceiver, ids: list[str]) -> None:
    """Every stored span of each rollout arrived over OTLP, with the rollout's ids, in the rollout's trace."""
    grouped = _by_rollout(receiver.snapshot())
    for rid in ids:
        stored = await store.spans.query_spans(rid)
        exported = grouped[rid]
        assert sorted(s.span_id for s in exported) == sorted(s.span_id for s in stored), (
            f"rollout {rid}: {len(exported)} of {len(stored)} span(s) exported"
        )
        rollout = await store.rollouts.get_rollout(rid)
        assert {s.attributes[semconv.ATTEMPT_ID] for s in exported} == {rollout.attempt_id}
        (trace_id,) = {s.trace_id_int for s in exported}
        assert trace_id == rollout_trace_id(rid)
        assert {s.resource.get("service.name") for s in exported} == {"fulmen-runner"}
    trace_ids = {s.trace_id for rid in ids for s in grouped[rid]}
    assert len(trace_ids) == len(ids)  # one trace per rollout, none shared


async def test_rollout_spans_arrive_over_otlp_as_one_trace_per_rollout(real_store, procs, receiver) -> None:
    """Each rollout's spans reach an OTLP/HTTP collector with its rollout and attempt ids, under its own trace id."""
    ids = await _run_and_stop(real_store, procs, receiver, "runner_test_agents:noop", schedule_delay_ms=100)
    await _assert_exported_as_stored(real_store, receiver, ids)
    names = [s.name for s in _by_rollout(receiver.snapshot())[ids[0]]]
    assert sorted(names) == sorted([semconv.MESSAGE_SPAN] * 7 + [semconv.ROLLOUT_SPAN, semconv.REWARD_SPAN])


async def test_sigterm_flushes_spans_not_yet_exported(real_store, procs, receiver) -> None:
    """On SIGTERM the runner flushes its OTLP batch: spans still waiting for the export schedule arrive."""
    ids = await _run_and_stop(real_store, procs, receiver, "runner_test_agents:noop", schedule_delay_ms=60_000)
    await _assert_exported_as_stored(real_store, receiver, ids)


async def test_sigterm_flushes_spans_of_a_sync_agent(real_store, procs, receiver) -> None:
    """A runner of a sync agent (spans ended in worker threads) also flushes its OTLP batch on SIGTERM."""
    ids = await _run_and_stop(
        real_store, procs, receiver, "runner_test_agents:sync_agent", schedule_delay_ms=60_000
    )
    await _assert_exported_as_stored(real_store, receiver, ids)


async def test_sigterm_exports_the_spans_of_a_handed_back_sync_agent(real_store, procs, receiver) -> None:
    """SIGTERM while a sync agent still runs: the runner exits at once and its attempt's spans reach OTLP."""
    env = child_env(
        procs.redis_url,
        procs.experiment,
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="60000",  # nothing goes out before the shutdown flush
    )
    runner = await procs.runner("runner_test_agents:sync_sleeps", "--grace-s", "0.5", env=env)
    await wait_until_ready(real_store, runner)
    rid = (await real_store.rollouts.enqueue_rollout({"sleep_s": 60.0})).rollout_id
    while not await real_store.spans.query_spans(rid, name=semconv.MESSAGE_SPAN):  # the agent is asleep
        await asyncio.sleep(0.05)
    runner.signal(signal.SIGTERM)
    assert await runner.wait(timeout_s=10.0) == 0, runner.stderr  # long before the thread's 60 s are up
    exported = {s.name for s in _by_rollout(receiver.snapshot())[rid]}
    assert exported == {semconv.MESSAGE_SPAN, semconv.ROLLOUT_SPAN}
