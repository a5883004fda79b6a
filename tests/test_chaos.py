"""Issue 7: a service SIGKILLed mid-run and started again with the same command does not stop the run
from finishing, and no rollout is lost or counted twice — checked against the store.

Every service runs as its own process (tests/chaos_harness.py); `bench/chaos.py` does the same for
every service, the embedded Redis included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chaos_harness import RUN, ChaosConfig, ChaosRun, chaos_case

from fulmen.records import RolloutConfig
from fulmen.store import RedisStore

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
async def test_killed_services_restart_and_the_run_loses_nothing(redis_url: str, experiment: str,
                                                                 tmp_path: Path) -> None:
    """SIGKILL the runner, then the trainer, then the algorithm mid-run, each at its moment, each
    started again with the same command: the run ends; every rollout once, every sample trained at
    most once. (One run for the three: each run costs half a minute of the suite.)"""
    # the trainer holds samples only while it waits for a batch or trains one (~0.6 s a step here),
    # and on a quiet machine 4 steps took under 4 s: enough steps that the run cannot end before the
    # harness's polls see each moment
    verdict = await chaos_case("runner+trainer+algorithm", tmp_path, experiment, ChaosConfig(total_steps=12),
                               redis_url=redis_url)
    assert verdict.ok, verdict.line()
    assert all(verdict.restarts.get(s, 0) >= 1 for s in ("runner", "trainer", "algorithm")), verdict.restarts
    assert verdict.lost == 0 and verdict.duplicated == 0 and verdict.not_terminal == 0
    assert verdict.rollouts == verdict.expected > 0 and verdict.trained_samples > 0


async def test_the_store_check_sees_a_lost_and_a_doubled_rollout(real_store: RedisStore, tmp_path: Path) -> None:
    """The checker fails a run whose group misses a rollout or whose rollout completed twice."""
    from fulmen.demo import arithmetic
    from fulmen.records import SampleSkip
    from fulmen_algorithm.scheduler import Scheduler, SchedulerOptions

    config = ChaosConfig(n_samples=2, train_tasks=4)
    arithmetic.write_jsonl(tmp_path / "train.jsonl", arithmetic.make_tasks("train", 4, seed=config.seed))
    from fulmen_algorithm.dataset import load_tasks

    scheduler = Scheduler(real_store, load_tasks(tmp_path / "train.jsonl"),
                          SchedulerOptions(n_samples=2, seed=config.seed), run=RUN, rollout_config=RolloutConfig())
    await scheduler.load()
    ids = await scheduler.enqueue_group()
    for claimed in await real_store.queue.dequeue_rollouts("w", 2):
        await real_store.rollouts.update_attempt(claimed.rollout.rollout_id, claimed.attempt.attempt_id, status="succeeded")
    await scheduler.count_finished()
    # the adapter's part: a rollout with nothing to train on still gets a skip record
    await real_store.samples.append_samples([
        (rid, [SampleSkip(rid, f"{rid}.1", rid.rsplit("-", 1)[0], "succeeded", "no LLM call").to_wire()], {})
        for rid in ids
    ])
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "sample_ids": []}) + "\n")
    run = ChaosRun(tmp_path, real_store.experiment, config, redis_url="unused")
    run.store, run.summary = real_store, {}

    clean = await run.check_store("none")
    assert clean.lost == 0 and clean.duplicated == 0 and not any("never" in p for p in clean.problems)
    # a rollout of the group vanished, and another one's completion was appended twice
    await real_store.redis.zrem(real_store.keys.rollout_index, ids[0])
    entry = (await real_store.redis.xrange(real_store.keys.finished, count=1))[0][1]
    await real_store.redis.xadd(real_store.keys.finished, entry)
    broken = await run.check_store("none")
    assert broken.lost == 1 and broken.duplicated >= 1 and not broken.ok


async def test_the_store_check_sees_a_double_success_a_retried_call_and_stale_samples(
    real_store: RedisStore, tmp_path: Path
) -> None:
    """The random-fault checks can fail: a rollout with two succeeded attempts, an attempt whose
    retried call was recorded twice, a sample two versions behind the weights that trained on it."""
    from chaos_harness import Verdict

    from fulmen import keys as k
    from fulmen.records import Span
    from fulmen.telemetry import semconv
    from fulmen_algorithm.scheduler import Scheduler, SchedulerOptions

    run = ChaosRun(tmp_path, real_store.experiment, ChaosConfig(max_staleness=1), redis_url="unused")
    run.store = real_store
    scheduler = Scheduler(real_store, [{"id": "t", "question": "1+1=", "answer": "2"}],
                          SchedulerOptions(n_samples=1), run=RUN, rollout_config=RolloutConfig(max_attempts=2))
    await scheduler.load()
    (rid,) = await scheduler.enqueue_group()
    (claimed,) = await real_store.queue.dequeue_rollouts("w", 1)
    attempt = claimed.attempt.attempt_id
    await real_store.rollouts.update_attempt(rid, attempt, status="succeeded")
    rollouts = await real_store.rollouts.get_rollouts([rid])
    call = {semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.CALL_KEY: "key-1"}
    await real_store.spans.add_spans([Span(rid, attempt, "s1", "chat", attributes=call)])
    run._samples_of[attempt] = 1

    clean = Verdict("none")
    await run._check_attempts_and_calls(clean, rollouts)
    run._check_staleness(clean, [{"step": 1, "model_version": "v1", "sample_ids": ["a"]},
                                 {"step": 2, "model_version": "v2", "sample_ids": ["b"]}], {"a": 0, "b": 0})
    assert clean.problems == [] and clean.max_staleness == 1

    # a second succeeded attempt, the call's retry stored as a span of its own, a sample two behind
    second = k.attempt_id(rid, 2)
    await real_store.redis.hset(real_store.keys.attempt(second),
                                mapping={**await real_store.redis.hgetall(real_store.keys.attempt(attempt)),
                                         b"attempt_id": second, b"sequence_id": 2})
    await real_store.redis.hset(real_store.keys.rollout(rid), "attempt_n", 2)
    await real_store.spans.add_spans([Span(rid, attempt, "s2", "chat", attributes=call)])
    broken = Verdict("none")
    await run._check_attempts_and_calls(broken, rollouts)
    run._check_staleness(broken, [{"step": 1, "model_version": "v1", "sample_ids": []},
                                  {"step": 2, "model_version": "v2", "sample_ids": []},
                                  {"step": 3, "model_version": "v3", "sample_ids": ["c"]}], {"c": 0})
    assert broken.succeeded_twice == 1 and broken.from_retried_calls == 1 and broken.max_staleness == 2
    assert len(broken.problems) == 3
