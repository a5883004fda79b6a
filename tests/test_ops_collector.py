"""The pipeline collector and the counters collector against a store with known contents (exact values)."""

from __future__ import annotations

import asyncio

import pytest
import redis
from prometheus_client import CollectorRegistry

from fulmen import keys as k
from fulmen.cli.top import sparkline
from fulmen.records import TrainStep
from fulmen.store import RedisStore
from fulmen.store.statistics import read_snapshot
from fulmen.telemetry.metrics import CountersCollector, CounterValue, PipelineCollector
from fulmen.telemetry.steps import read_steps


def _registry(collector: object) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)  # type: ignore[arg-type]
    return registry


async def _known_contents(store: RedisStore) -> None:
    """5 rollouts: 2 claimed (1 of them succeeded), 3 queued; 1 dead letter; 1 completion read by the
    adapter and not acknowledged; 1 worker; model version v3."""
    for i in range(5):
        await store.rollouts.enqueue_rollout({"q": i}, rollout_id=f"r{i}")
    claimed = await store.queue.dequeue_rollouts("w1", 2)
    assert len(claimed) == 2
    done = claimed[0]
    await store.rollouts.update_attempt(done.rollout.rollout_id, done.attempt.attempt_id, status="succeeded")
    await store.dead_letters.dead_letter(store.keys.queue, "1-0", "poison", {b"m": b"junk"})
    await store.finished.ensure_finished_group(k.ADAPTER_GROUP)
    assert len(await store.finished.read_finished(k.ADAPTER_GROUP, "adapter-1", count=10)) == 1
    await store.samples.ensure_samples_group()
    await store.registry.update_worker("w1", "busy")
    await store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny", "model_version": "v3"}}, resources_id="policy")


async def test_pipeline_gauges_match_the_store(real_store: RedisStore, redis_url: str) -> None:
    """Queue depth, rollouts per status, streams, pending, consumers, workers, model version: exact."""
    await _known_contents(real_store)
    await asyncio.sleep(0.05)  # the oldest queued entry is measurably old
    client = redis.Redis.from_url(redis_url)
    try:
        r = _registry(PipelineCollector(client, real_store.keys))
        value = r.get_sample_value
        assert value("fulmen_redis_up") == 1
        assert value("fulmen_queue_depth") == 3
        assert [value("fulmen_queue_depth_by_lane", {"lane": lane}) for lane in k.LANES] == [0, 3, 0]
        assert value("fulmen_active_attempts") == 1
        expected = {"queuing": 3, "preparing": 1, "running": 0, "requeuing": 0, "succeeded": 1, "failed": 0,
                    "cancelled": 0}
        for status, n in expected.items():
            assert value("fulmen_rollouts", {"status": status}) == n
        assert value("fulmen_dead_letters") == 1
        for stream, n in {"queue": 5, "finished": 1, "samples": 0, "dead_letters": 1}.items():
            assert value("fulmen_stream_length", {"stream": stream}) == n
        queue = {"stream": "queue", "group": k.RUNNERS_GROUP}
        adapter = {"stream": "finished", "group": k.ADAPTER_GROUP}
        trainers = {"stream": "samples", "group": k.TRAINERS_GROUP}
        assert value("fulmen_pending_entries", queue) == 0  # the claim acknowledges the queue entry
        assert value("fulmen_pending_entries", adapter) == 1
        assert value("fulmen_pending_entries", trainers) == 0
        assert value("fulmen_group_consumers", queue) == 1
        assert value("fulmen_group_consumers", adapter) == 1
        assert value("fulmen_group_consumers", trainers) == 0
        assert 0.05 <= value("fulmen_consumer_lag_seconds", queue) < 60  # 3 entries never delivered
        assert value("fulmen_consumer_lag_seconds", adapter) == 0  # read everything there is
        assert value("fulmen_pending_entries", {"stream": "finished", "group": k.ALGORITHM_GROUP}) is None
        assert value("fulmen_workers") == 1
        assert value("fulmen_model_version") == 3
    finally:
        client.close()


async def test_empty_experiment_and_unreachable_redis(real_store: RedisStore, redis_url: str) -> None:
    """Nothing stored: zeros and no groups; Redis gone: fulmen_redis_up 0 and nothing else."""
    client = redis.Redis.from_url(redis_url)
    try:
        snap = read_snapshot(client, real_store.keys)
        assert snap.queue_depth == 0 and snap.groups == {} and snap.model_version is None
        r = _registry(PipelineCollector(client, real_store.keys))
        assert r.get_sample_value("fulmen_queue_depth") == 0
        assert r.get_sample_value("fulmen_model_version") is None
    finally:
        client.close()
    from fulmen.store.redis.embedded import free_port

    gone = redis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    r = _registry(PipelineCollector(gone, real_store.keys))
    assert r.get_sample_value("fulmen_redis_up") == 0
    assert r.get_sample_value("fulmen_queue_depth") is None


async def test_statistics_still_reads_the_same(real_store: RedisStore) -> None:
    """`RedisStore.statistics` (now built on the shared snapshot) reports the known contents."""
    await _known_contents(real_store)
    stats = await real_store.statistics()
    assert stats["queue_depth"] == 3 and stats["active_attempts"] == 1 and stats["total_rollouts"] == 5
    assert stats["dead_letters"] == 1 and stats["finished"] == 1 and stats["workers"] == 1
    assert stats["pending"] == {"w1": 0}
    assert stats["latest_resources"]["resources_id"] == "policy"


def test_counters_collector_reads_live_values() -> None:
    """Counters are read from the service's objects at each scrape, labels and all."""
    state = {"claims": 2, "ok": 5}
    values = lambda: [  # noqa: E731 - a one-line reader, as services pass it
        CounterValue("fulmen_x_claims", "claims", state["claims"]),
        CounterValue("fulmen_x_ends", "ends", state["ok"], {"outcome": "ok"}),
        CounterValue("fulmen_x_ends", "ends", 1, {"outcome": "crashed"}),
    ]
    r = _registry(CountersCollector(values))
    assert r.get_sample_value("fulmen_x_claims_total") == 2
    assert r.get_sample_value("fulmen_x_ends_total", {"outcome": "ok"}) == 5
    assert r.get_sample_value("fulmen_x_ends_total", {"outcome": "crashed"}) == 1
    state["claims"] = 7
    assert r.get_sample_value("fulmen_x_claims_total") == 7


async def test_trainer_leader_logs_steps_for_the_curve(real_store: RedisStore, redis_url: str) -> None:
    """StepMetrics with a store appends one record per step, all its metrics; read_steps returns them oldest first."""
    from fulmen_trainer.metrics import StepMetrics

    metrics = StepMetrics(0)
    metrics.log_steps_to(real_store)
    for step, reward in enumerate([0.1, 0.5, 0.9], start=1):
        metrics.record(step, {"rollout/reward_mean": reward, "loss/total": -0.5, "perf/samples": 8,
                              "model_version": f"v{step}"})
    await asyncio.gather(*metrics._writes)
    client = redis.Redis.from_url(redis_url)
    try:
        steps = read_steps(client, real_store.keys)
    finally:
        client.close()
    assert [s.step for s in steps] == [1, 2, 3]
    assert steps[-1] == TrainStep(3, "v3", 0.9, -0.5, 8, steps[-1].time,
                                  {"rollout/reward_mean": 0.9, "loss/total": -0.5, "perf/samples": 8.0})
    assert metrics.registry.get_sample_value("fulmen_trainer_rollout_reward_mean", {"rank": "0"}) == 0.9


@pytest.mark.parametrize(("values", "expected"), [([], ""), ([1, 1], "▁▁"), ([0, 0.5, 1], "▁▅█")])
def test_sparkline(values: list[float], expected: str) -> None:
    """One bar per value, from the lowest to the highest."""
    assert sparkline(values) == expected
