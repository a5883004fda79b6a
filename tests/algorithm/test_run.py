"""The algorithm's `Run`: ends at total_steps, schedules validation, and resumes its schedule from the store."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fulmen.records import ProxyEndpoint, TrainStep
from fulmen.settings import AlgorithmSettings
from fulmen.store import RedisStore
from fulmen.telemetry.steps import append_step, latest_step
from fulmen_algorithm.dataset import task_id
from fulmen_algorithm.run import Run
from fulmen_algorithm.run_state import RunProgress
from fulmen_algorithm.scheduler import Scheduler
from fulmen_algorithm.validation import validate

TASKS = [{"id": f"t{i}", "question": f"{i}+1="} for i in range(4)]
VAL = [{"id": "v0", "question": "1+1="}]
MANY_TASKS = [{"id": f"t{i}", "question": f"{i}+1="} for i in range(20)]


async def test_run_ends_validates_on_schedule_and_resumes(
    real_store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At version 1 with total_steps 1: one pass of version 1 queued, the next due at 1 + val_every
    (kept in the store), the summary written; a restarted run queues no pass again."""
    queued: list[int] = []
    monkeypatch.setattr("fulmen_algorithm.run.enqueue_validation", lambda _settings, step: queued.append(step))
    monkeypatch.setattr("fulmen_algorithm.run.pending_validations", lambda _settings, versions: ([], True))

    async def at_step_one(_self: Scheduler) -> int:
        return 1

    monkeypatch.setattr(Scheduler, "trainer_step", at_step_one)
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "m", "model_version": "base"}}, resources_id="policy")
    settings = AlgorithmSettings(
        experiment=real_store.experiment, data_dir=tmp_path, metrics_file=tmp_path / "m.jsonl", n_samples=2,
        groups_per_step=1, max_inflight=4, total_steps=1, val_every=5, val_timeout_s=0.5,
    )
    summary = await Run(settings, TASKS, VAL).run(real_store)
    assert queued == [1]
    assert await RunProgress(real_store).next_validation() == 6
    assert summary["steps"] == 1 and summary["final_val_accuracy"] == 0.0
    assert summary["groups"] == 0  # the trainer was at step 1 already: no group would be trained on
    assert json.loads((tmp_path / "run" / real_store.experiment / "summary.json").read_text())["steps"] == 1
    await Run(settings, TASKS, VAL).run(real_store)
    assert queued == [1]  # version 1's pass is not queued twice


@pytest.mark.parametrize("evaluator", ["ends the pass", "between two workers", "not running", "never ends it"])
async def test_the_final_pass_waits_for_the_evaluators_pass_the_run_queued(
    real_store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    evaluator: str,
) -> None:
    """The pass of version 1, queued for the evaluator, still under way when the run ends: the final pass
    starts only once it has ended, so the curve has every scheduled pass. An evaluator unseen for a moment
    (between two of its rq workers) is waited for; with none listening for EVALUATOR_ABSENT_S, the run
    does not wait for it; with one that never ends it, it waits val_timeout_s; each says why."""
    events: list[str] = []
    monkeypatch.setattr("fulmen_algorithm.run.enqueue_validation", lambda _settings, step: events.append(f"queued v{step}"))

    def pending(_settings: AlgorithmSettings, versions: list[int]) -> tuple[list[int], bool]:
        events.append("asked")
        asked = events.count("asked")
        ended = evaluator in ("ends the pass", "between two workers") and asked >= 3
        listening = evaluator != "not running" and not (evaluator == "between two workers" and asked == 1)
        return ([] if ended else versions), listening

    monkeypatch.setattr("fulmen_algorithm.run.pending_validations", pending)
    monkeypatch.setattr("fulmen_algorithm.run.PASS_POLL_S", 0.01)  # well within the pass's timeout of 0.5 s
    monkeypatch.setattr("fulmen_algorithm.run.EVALUATOR_ABSENT_S", 0.1)
    real_validate = validate

    async def final_pass(*args: Any, **kwargs: Any) -> dict[str, Any]:
        events.append(f"pass {kwargs['label']}")
        return await real_validate(*args, **kwargs)

    monkeypatch.setattr("fulmen_algorithm.run.validate", final_pass)

    async def at_step_one(_self: Scheduler) -> int:
        return 1

    monkeypatch.setattr(Scheduler, "trainer_step", at_step_one)
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "m", "model_version": "base"}}, resources_id="policy")
    settings = AlgorithmSettings(experiment=real_store.experiment, data_dir=tmp_path, n_samples=2, groups_per_step=1,
                                 total_steps=1, val_every=5, val_timeout_s=0.5)
    with caplog.at_level(logging.INFO, logger="fulmen.algorithm"):
        summary = await Run(settings, TASKS, VAL).run(real_store)
    asked = events.count("asked")
    assert events == ["queued v1", *["asked"] * asked, "pass final"]
    if evaluator in ("ends the pass", "between two workers"):
        assert asked == 3 and "waiting for the evaluator's validation pass of v1" in caplog.text
        assert "no `fulmen evaluator` is running" not in caplog.text
    elif evaluator == "not running":
        assert asked > 1 and "no `fulmen evaluator` is running" in caplog.text  # asked again for 0.1 s
    else:
        assert asked > 10 and "the validation pass of v1 has not ended within val_timeout_s (0.5 s)" in caplog.text
    assert summary["final_val_accuracy"] == 0.0


async def test_a_stopped_run_skips_the_final_validation(real_store: RedisStore, tmp_path: Path) -> None:
    """SIGTERM (`stop`) ends the loop with no final pass, says it stopped, and leaves the report of a
    run that had finished exactly as it was (issue 20, item 6)."""
    settings = AlgorithmSettings(experiment=real_store.experiment, data_dir=tmp_path, epochs=1, n_samples=2)
    (tmp_path / "run" / real_store.experiment).mkdir(parents=True)
    (tmp_path / "run" / real_store.experiment / "summary.json").write_text('{"steps": 300, "final_val_accuracy": 0.95}')
    run = Run(settings, TASKS, VAL)
    run.stop()
    summary = await run.run(real_store)
    assert "final_val_accuracy" not in summary and summary["steps"] == 0 and summary["stopped"] is True
    report = tmp_path / "run" / real_store.experiment
    assert json.loads((report / "summary.json").read_text()) == {"steps": 300, "final_val_accuracy": 0.95}
    assert not (report / "reward-curve.png").exists()


async def _runner_and_trainer(store: RedisStore, groups_per_step: int, group_size: int,
                              claimed_ids: list[str] | None = None) -> None:
    """Stand-ins for the runners, the trainer and a torch proxy: every queued rollout succeeds (its id
    appended to ``claimed_ids`` as it is claimed), the trainer steps (appending its summary as v<step>)
    each time ``groups_per_step`` more groups are complete, as long as rollouts keep coming, whether the
    algorithm still runs or not, and the proxy serves the newest version at once (the pacing waits for
    what is served)."""
    done: Counter[str] = Counter()
    step = 0
    while True:
        await store.registry.register_proxy(ProxyEndpoint("proxy", "http://proxy:1", "m", f"v{step}" if step else "base",
                                                          metadata={"backend": "torch"}))
        for claimed in await store.queue.dequeue_rollouts("w", 100):
            await store.rollouts.update_attempt(claimed.rollout.rollout_id, claimed.attempt.attempt_id,
                                                status="succeeded", reward=1.0)
            if claimed_ids is not None:
                claimed_ids.append(claimed.rollout.rollout_id)
            if group := claimed.rollout.metadata.get("group_key"):
                done[group] += 1
        complete = sum(1 for n in done.values() if n == group_size)
        while complete >= (step + 1) * groups_per_step:
            step += 1
            await append_step(store.redis, store.keys, TrainStep(step, f"v{step}", 0.5, 0.0, 8, time.time()))
        await asyncio.sleep(0.02)


async def test_total_steps_n_trains_exactly_n_steps_and_reports_per_experiment(
    real_store: RedisStore, tmp_path: Path
) -> None:
    """--total-steps 4 running a round ahead (staleness 1): the trainer takes steps 1 to 4 (the last
    version v4) and no more once the run ended; the report lands in run/<experiment>/."""
    settings = AlgorithmSettings(
        experiment=real_store.experiment, data_dir=tmp_path, metrics_file=tmp_path / "m.jsonl", n_samples=2,
        groups_per_step=2, max_inflight=100, staleness=1, total_steps=4,
    )
    pipeline = asyncio.create_task(_runner_and_trainer(real_store, groups_per_step=2, group_size=2))
    try:
        summary = await asyncio.wait_for(Run(settings, MANY_TASKS, []).run(real_store), 30)
        await asyncio.sleep(1.0)  # whatever the run left queued would be trained on now
    finally:
        pipeline.cancel()
    assert summary["steps"] == 4 and summary["groups"] == 8
    assert await latest_step(real_store.redis, real_store.keys) == 4
    report = json.loads((tmp_path / "run" / real_store.experiment / "summary.json").read_text())
    assert report["steps"] == 4 and not (tmp_path / "run" / "summary.json").exists()


async def test_a_run_stopped_during_its_final_validation_ends_at_once(
    real_store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while the final pass waits for its rollouts (up to val_timeout_s): the run ends within
    a second, says it stopped, and writes no report."""
    async def at_the_end(_self: Scheduler) -> int:
        return 1

    monkeypatch.setattr(Scheduler, "trainer_step", at_the_end)
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "m", "model_version": "base"}}, resources_id="policy")
    settings = AlgorithmSettings(experiment=real_store.experiment, data_dir=tmp_path, total_steps=1, n_samples=2,
                                 val_timeout_s=120)
    run = Run(settings, TASKS, VAL)  # at step 1 of 1: straight to the final pass, which no runner serves
    ending = asyncio.create_task(run.run(real_store))
    final_pass = f"val-final-{task_id(VAL[0])}"  # the final pass's rollout: enqueued, never run
    while (await real_store.rollouts.get_rollouts([final_pass])) == [None]:
        assert not ending.done(), ending.result()
        await asyncio.sleep(0.05)
    started = time.monotonic()
    run.stop()
    summary = await asyncio.wait_for(ending, 5)
    assert time.monotonic() - started < 1.0
    assert summary["stopped"] is True and "final_val_accuracy" not in summary
    assert not (tmp_path / "run" / real_store.experiment / "summary.json").exists()



async def test_the_baseline_is_served_before_training_and_recorded_without_an_evaluator(
    real_store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The pass of the starting weights (v0) measures them however late the evaluator comes: the run
    queues its rollouts before the first training rollout, and they are claimed first. With no evaluator
    listening at the end, the run waits for those rollouts and records v0 itself; a periodic pass, whose
    rollouts only the evaluator queues, is left to it, as the log says."""
    queued: list[int] = []
    monkeypatch.setattr("fulmen_algorithm.run.enqueue_validation", lambda _settings, step: queued.append(step))
    monkeypatch.setattr("fulmen_algorithm.run.pending_validations", lambda _settings, versions: (versions, False))
    monkeypatch.setattr("fulmen_algorithm.run.PASS_POLL_S", 0.01)
    monkeypatch.setattr("fulmen_algorithm.run.EVALUATOR_ABSENT_S", 0.1)
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "m", "model_version": "base"}},
                                             resources_id="policy")
    settings = AlgorithmSettings(
        experiment=real_store.experiment, data_dir=tmp_path, metrics_file=tmp_path / "m.jsonl", n_samples=2,
        groups_per_step=2, max_inflight=100, total_steps=2, val_every=2, val_timeout_s=5,
    )
    claimed: list[str] = []
    pipeline = asyncio.create_task(_runner_and_trainer(real_store, groups_per_step=2, group_size=2, claimed_ids=claimed))
    try:
        with caplog.at_level(logging.INFO, logger="fulmen.algorithm"):
            summary = await asyncio.wait_for(Run(settings, MANY_TASKS, VAL).run(real_store), 30)
    finally:
        pipeline.cancel()
    assert queued == [0, 2]  # both passes are still the evaluator's jobs
    assert claimed[0] == f"val-v0-{task_id(VAL[0])}", claimed[:3]  # ahead of every training rollout
    assert [v["label"] for v in summary["validations"]] == ["v0", "final"]
    assert summary["validations"][0]["accuracy"] == 1.0  # its rollout's reward, read once it had ended
    assert "the baseline pass (v0), whose rollouts this run queued, is recorded here" in caplog.text
    assert "the validation pass of v2 is still queued and no `fulmen evaluator` is running" in caplog.text
