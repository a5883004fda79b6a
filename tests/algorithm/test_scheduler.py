"""The algorithm's scheduler against a real Redis: groups, pacing, backpressure, resume, top-ups."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from fulmen.errors import InvalidInput
from fulmen.records import TrainStep
from fulmen.store import RedisStore
from fulmen.telemetry.steps import append_step
from fulmen.versions.model_version import POLICY_RESOURCES_ID
from fulmen_algorithm.dataset import load_tasks, task_id
from fulmen_algorithm.scheduler import Scheduler, SchedulerOptions

TASKS = [{"id": f"q{i}", "question": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]


async def _trainer_step(store: RedisStore, step: int, version: str | None = None, *, served: bool = True) -> None:
    """What the trainer's leader does after each step: append its summary (the version it holds,
    ``v<step>`` unless given) to the steps stream; ``served``: a torch proxy then serves that version."""
    version = version or f"v{step}"
    await append_step(store.redis, store.keys, TrainStep(step, version, 0.5, 0.0, 8, time.time()))
    if served:
        await _serve(store, version)


async def _serve(store: RedisStore, version: str, proxy_id: str = "stand-in", backend: str = "torch") -> None:
    """A proxy registers the version it serves (a torch proxy loads it itself; others forward)."""
    from fulmen.records import ProxyEndpoint

    await store.registry.register_proxy(ProxyEndpoint(proxy_id, f"http://{proxy_id}:1", "m", version, time.time(),
                                                      {"backend": backend}))


async def _finish(store: RedisStore, count: int) -> None:
    """A stand-in runner: claim and succeed ``count`` rollouts."""
    for claimed in await store.queue.dequeue_rollouts("w", count):
        await store.rollouts.update_attempt(claimed.rollout.rollout_id, claimed.attempt.attempt_id, status="succeeded")


async def test_groups_are_n_rollouts_of_one_task_with_group_metadata(real_store: RedisStore) -> None:
    """A group is n train rollouts of one task, sharing a group key, with the group size."""
    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=3, groups_per_step=1, max_inflight=100))
    await s.load()
    ids = await s.enqueue_group()
    rollouts = await real_store.rollouts.get_rollouts(ids)
    assert len({r.input["id"] for r in rollouts}) == 1
    assert {r.metadata["group_key"] for r in rollouts} == {ids[0].rsplit("-", 1)[0]}
    assert {r.metadata["group_size"] for r in rollouts} == {3}
    assert {r.mode.value for r in rollouts} == {"train"} and {r.resources_id for r in rollouts} == {POLICY_RESOURCES_ID}


async def test_synchronous_pacing_waits_for_each_trainer_step(real_store: RedisStore) -> None:
    """Staleness 0: one round of groups per trainer step (read from its steps stream), no more."""
    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=2, max_inflight=100, staleness=0))
    await s.load()
    assert await s.fill() == 2
    assert await s.fill() == 0
    await _trainer_step(real_store, 1)
    assert await s.fill() == 2
    assert s.state.groups == 4


async def test_staleness_one_runs_a_round_ahead(real_store: RedisStore) -> None:
    """Staleness 1: two rounds before the first trainer step, then one more per step."""
    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=1, max_inflight=100, staleness=1))
    await s.load()
    assert await s.fill() == 2
    await _trainer_step(real_store, 1)
    assert await s.fill() == 1


async def test_backpressure_caps_rollouts_in_flight(real_store: RedisStore) -> None:
    """Never more than max_inflight train rollouts unfinished; finishing some makes room."""
    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=4, groups_per_step=10, max_inflight=8, staleness=5))
    await s.load()
    assert await s.fill() == 2
    await _finish(real_store, 4)
    assert await s.fill() == 1
    assert await s.inflight() == 8


async def test_a_restarted_scheduler_continues_and_never_enqueues_a_task_twice(real_store: RedisStore) -> None:
    """State lives in the store: a new scheduler resumes; a group enqueued but not recorded is not doubled."""
    first = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=2, max_inflight=100, seed=7))
    await first.load()
    await first.fill()
    # crash right after enqueuing the next group, before recording it:
    replayed = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=2, max_inflight=100, seed=7))
    await replayed.load()
    s = replayed.state
    task = TASKS[replayed.order(s.epoch)[s.cursor]]
    await real_store.rollouts.enqueue_rollouts([real_store.rollouts.new_rollout(task, rollout_id=f"run-e0-{task_id(task)}-{i}") for i in range(2)])
    second = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=2, max_inflight=100, seed=7))
    assert (await second.load()).groups == 2
    await _trainer_step(real_store, 1)
    assert await second.fill() == 2
    stats = await real_store.statistics()
    assert stats["total_rollouts"] == second.state.enqueued == 8
    ids = [r.rollout_id for r in await real_store.rollouts.query_rollouts()]
    assert len(ids) == len(set(ids)) == 8


async def test_epochs_wrap_and_end(real_store: RedisStore) -> None:
    """Every task once per epoch, in a seed-fixed order; nothing after the last epoch."""
    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=100, max_inflight=1000, epochs=2))
    await s.load()
    assert await s.fill() == 10
    assert s.exhausted and await s.fill() == 0
    inputs = [r.input["id"] for r in await real_store.rollouts.query_rollouts() if r.rollout_id.endswith("-0")]
    assert sorted(inputs) == sorted([t["id"] for t in TASKS] * 2)


async def test_a_stalled_trainer_gets_one_more_group(real_store: RedisStore) -> None:
    """The safety net: nothing in flight and no new trainer step for stall_s: one extra group."""
    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=1, max_inflight=100, stall_s=0.1))
    await s.load()
    assert await s.fill() == 1
    await _finish(real_store, 2)
    assert await s.fill() == 0  # the trainer may still step on it
    await asyncio.sleep(0.2)
    assert await s.fill() == 1


async def test_groups_the_trainer_did_not_train_on_are_replaced_at_once(real_store: RedisStore) -> None:
    """The trainer lists the groups it took without a step: one more group each, with rollouts still
    in flight and no stall; another run's groups and a group listed twice do not count."""
    from fulmen.telemetry.steps import record_untrained_groups

    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=2, max_inflight=100, stall_s=3600))
    await s.load()
    assert await s.fill() == 2
    first, second = [f"run-{g}" for g in ("e0-" + task_id(TASKS[s.order(0)[i]]) for i in range(2))]
    await record_untrained_groups(real_store.redis, real_store.keys, [first, "other-e0-q1"])
    assert await s.fill() == 1
    await record_untrained_groups(real_store.redis, real_store.keys, [first, second])
    assert await s.fill() == 1
    assert await s.fill() == 0 and s.state.groups == 4


async def test_replacing_untrained_groups_is_capped_by_what_the_trainer_trained(real_store: RedisStore) -> None:
    """Every group dropped (say, every sample too stale): at most one round of replacements per round
    trained, not rollouts at full speed."""
    from fulmen.telemetry.steps import record_untrained_groups

    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=1, max_inflight=100, stall_s=3600,
                                                      epochs=None))
    await s.load()
    assert await s.fill() == 1
    await record_untrained_groups(real_store.redis, real_store.keys, [f"run-e{i}-x" for i in range(10)])
    assert await s.fill() == 1  # one round's worth before the trainer's first step
    assert await s.fill() == 0
    await _trainer_step(real_store, 1)
    assert await s.fill() == 2  # the next round, and one more replacement
    assert await s.fill() == 0


async def test_groups_dynamic_sampling_left_out_are_replaced_up_to_ten_rounds(real_store: RedisStore) -> None:
    """DAPO leaves out every group whose rewards are all equal and samples more until the step is full:
    those are replaced beyond the cap on lost groups (a weak policy leaves out most of its groups), up
    to FILTERED_ROUNDS rounds per round trained, and the lost groups keep their own cap."""
    from fulmen.telemetry.steps import record_untrained_groups
    from fulmen_algorithm.scheduler import FILTERED_ROUNDS

    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=1, max_inflight=1000, stall_s=3600,
                                                      epochs=None))
    await s.load()
    assert await s.fill() == 1
    await record_untrained_groups(real_store.redis, real_store.keys, [f"run-e{i}-x" for i in range(15)], filtered=True)
    assert await s.fill() == FILTERED_ROUNDS  # ten rounds' worth before the trainer's first step
    assert await s.fill() == 0
    await record_untrained_groups(real_store.redis, real_store.keys, [f"run-e{i}-lost" for i in range(3)])
    assert await s.fill() == 1  # the lost ones: one round's worth, as before
    await _trainer_step(real_store, 1)
    assert await s.fill() == 1 + 5 + 1  # the next round, the five left out beyond the cap, one more lost


def test_dataset_errors_name_the_line(tmp_path: Path) -> None:
    """A bad dataset line or a duplicate id is refused with the file, line and reason."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\nnot json\n')
    with pytest.raises(InvalidInput, match=r"bad\.jsonl:2: not valid JSON"):
        load_tasks(bad)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": 1}\n{"id": 1}\n')
    with pytest.raises(InvalidInput, match="duplicate task ids"):
        load_tasks(dup)
    with pytest.raises(InvalidInput, match="does not exist"):
        load_tasks(tmp_path / "none.jsonl")


async def test_completions_read_before_a_kill_are_counted_after_the_restart(real_store: RedisStore) -> None:
    """A scheduler killed between reading completions and acknowledging them: its successor counts them."""
    from fulmen import keys as k

    first = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=1, max_inflight=100))
    await first.load()
    assert await first.fill() == 1
    await _finish(real_store, 2)
    # what the killed process did: the completions were delivered to it, never counted nor acknowledged
    assert len(await real_store.finished.read_finished(k.ALGORITHM_GROUP, "algorithm", count=10)) == 2
    second = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=1, max_inflight=100))
    await second.load()
    assert await second.inflight() == 0
    assert (await real_store.redis.xpending(real_store.keys.finished, k.ALGORITHM_GROUP))["pending"] == 0


async def test_a_dead_runners_train_rollouts_are_retried(real_store: RedisStore) -> None:
    """Train rollouts carry a heartbeat deadline: the watchdog requeues the attempts of a runner that died."""
    from fulmen.records.status import RolloutStatus
    from fulmen.watchdog import sweep
    from fulmen_algorithm.scheduler import recoverable_rollout_config

    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=1, max_inflight=100),
                  rollout_config=recoverable_rollout_config(unresponsive_s=0.1))
    await s.load()
    ids = await s.enqueue_group()
    claimed = await real_store.queue.dequeue_rollouts("runner-that-dies", 2)
    assert len(claimed) == 2  # ...and its process is SIGKILLed: no heartbeat, no report
    await asyncio.sleep(0.3)
    assert (await sweep(real_store))["requeued"] == 2
    rollouts = await real_store.rollouts.get_rollouts(ids)
    assert all(r is not None and r.status is RolloutStatus.REQUEUING for r in rollouts)
    retried = await real_store.queue.dequeue_rollouts("another-runner", 2)
    assert sorted(c.attempt.attempt_id for c in retried) == sorted(f"{rid}.2" for rid in ids)


async def test_staleness_zero_waits_for_every_server_to_serve_the_trainers_version(real_store: RedisStore) -> None:
    """On-policy for real: after step 1 the next round waits until the torch proxy and the ready vLLM
    replica serve v1 (a replica that is loading takes no calls and does not count)."""
    from fulmen.records import ProxyEndpoint, ReplicaState

    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=1, max_inflight=100, staleness=0))
    await s.load()
    proxy = ProxyEndpoint("p0", "http://127.0.0.1:1", "m", "base", time.time(), {"backend": "torch"})
    await real_store.registry.register_proxy(proxy)
    await real_store.registry.register_proxy(ProxyEndpoint("up", "http://127.0.0.1:2", "m", "base", time.time(),
                                                  {"backend": "vllm"}))  # forwards: not counted itself
    await real_store.registry.set_replica(ReplicaState("http://127.0.0.1:3", "base", ready=True))
    await real_store.registry.set_replica(ReplicaState("http://127.0.0.1:4", "v0", ready=False, reason="loading v1"))
    assert await s.fill() == 1
    await _trainer_step(real_store, 1, served=False)
    assert await s.fill() == 0  # trained, not yet served
    await real_store.registry.register_proxy(ProxyEndpoint(**{**_fields(proxy), "model_version": "v1"}))
    assert await s.fill() == 0  # the replica still serves the base
    await real_store.registry.set_replica(ReplicaState("http://127.0.0.1:3", "v1", ready=True))
    assert await s.fill() == 1


async def _steps_publishing_every_three(store: RedisStore, last: int, start: int = 1) -> None:
    """The steps stream of a trainer at ``--publish-every 3``: steps 1-2 hold the base weights, 3-5 v1,
    6-8 v2 (each step's record names the version the trainer holds after it)."""
    for step in range(start, last + 1):
        await _trainer_step(store, step, "base" if step < 3 else f"v{step // 3}", served=False)


async def test_staleness_counts_trainer_steps_when_a_version_is_published_every_three(real_store: RedisStore) -> None:
    """--publish-every 3, trainer at step 6, every proxy serving v1 (step 3's weights), staleness 0:
    the rounds for steps 0 to 3 and not those for steps 4 and 5; v2 served: the round for step 6."""
    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=1, max_inflight=100, staleness=0,
                                                      stall_s=3600))
    await s.load()
    await _steps_publishing_every_three(real_store, 6)
    await _serve(real_store, "v1")
    await _serve(real_store, "v2", proxy_id="ahead")  # the slowest server counts
    assert await s.fill() == 4
    assert await s.fill() == 0
    await _serve(real_store, "v2")
    assert await s.fill() == 3 and s.state.groups == 7


async def test_when_servers_stop_reporting_the_gate_holds_at_the_last_step_served(real_store: RedisStore,
                                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """No server ever reported a version (only proxies that forward upstream): rounds follow the
    trainer, with a warning. Once one did, its last served step holds while none reports (a proxy
    restarting), however far the trainer goes."""
    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=2, max_inflight=100, staleness=0,
                                                      stall_s=3600))
    await s.load()
    await _steps_publishing_every_three(real_store, 3)
    await _serve(real_store, "v1", proxy_id="upstream", backend="openai")
    with caplog.at_level(logging.WARNING):
        assert await s.fill() == 8  # the rounds for steps 0 to 3
    assert "rounds follow the trainer's steps" in caplog.text
    await _serve(real_store, "v1")  # a torch proxy: step 3 served
    assert await s.fill() == 0
    await real_store.registry.unregister_proxy("stand-in")
    await _steps_publishing_every_three(real_store, 6, start=4)
    assert await s.fill() == 0  # step 3 is the last served: nothing for steps 4 to 6 yet
    await _serve(real_store, "v2")
    assert await s.fill() == 6  # the rounds for steps 4 to 6


async def test_the_serving_lag_is_counted_in_trainer_steps(real_store: RedisStore) -> None:
    """The lag from the step each served version was published at: unknown with no server, the base
    weights are step 0, and a version no step's record names yet holds the trainer's last step."""
    from fulmen.serving.lag import VersionSteps, served_step, serving_lag

    await _steps_publishing_every_three(real_store, 7)
    assert await serving_lag(real_store) is None
    await _serve(real_store, "base")
    assert await serving_lag(real_store) == 7
    await _serve(real_store, "v1")
    assert await served_step(real_store) == 3 and await serving_lag(real_store) == 4
    steps = VersionSteps()
    await _serve(real_store, "v3")  # published by step 8, whose record the trainer writes after the publish
    assert await serving_lag(real_store, steps) == 0 and await served_step(real_store, steps) == 7
    await _trainer_step(real_store, 8, "v3", served=False)
    assert await served_step(real_store, steps) == 8  # not kept from before its record
    await _serve(real_store, "v2")
    assert await served_step(real_store, steps) == 6
    await real_store.redis.delete(real_store.keys.trainer_steps)
    assert await served_step(real_store, steps) == 6  # a version's step, once found, is kept


def _fields(record: object) -> dict:
    import dataclasses

    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}  # type: ignore[arg-type]


async def test_a_finished_entry_for_a_rollout_the_store_does_not_hold_is_not_counted(
    real_store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry naming a rollout of this run that was never enqueued is acknowledged with a warning, not
    counted: the rollouts in flight stay as many as were enqueued and not finished."""
    from fulmen import keys as k
    from fulmen.records import RolloutFinished, RolloutStatus

    s = Scheduler(real_store, TASKS, SchedulerOptions(n_samples=2, groups_per_step=1, max_inflight=100))
    await s.load()
    assert await s.fill() == 1
    ghost = f"{s.run}-e0-ghost"
    await real_store.redis.xadd(real_store.keys.finished,
                                {"m": RolloutFinished(ghost, RolloutStatus.SUCCEEDED, f"{ghost}.1").to_wire()})
    await _finish(real_store, 1)
    with caplog.at_level("WARNING", logger="fulmen_algorithm.scheduler"):
        assert await s.count_finished() == 1
    assert await s.inflight() == 1
    assert any(ghost in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert (await real_store.redis.xpending(real_store.keys.finished, k.ALGORITHM_GROUP))["pending"] == 0
