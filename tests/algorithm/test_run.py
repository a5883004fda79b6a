"""The algorithm's `Run`: ends at total_steps, schedules validation, and resumes its schedule from the store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fulmen.settings import AlgorithmSettings
from fulmen.store import RedisStore
from fulmen_algorithm.run import Run
from fulmen_algorithm.run_state import RunProgress
from fulmen_algorithm.scheduler import Scheduler

TASKS = [{"id": f"t{i}", "question": f"{i}+1="} for i in range(4)]
VAL = [{"id": "v0", "question": "1+1="}]


async def test_run_ends_validates_on_schedule_and_resumes(
    real_store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At version 1 with total_steps 1: one pass of version 1 queued, the next due at 1 + val_every
    (kept in the store), the summary written; a restarted run queues no pass again."""
    queued: list[int] = []
    monkeypatch.setattr("fulmen_algorithm.run.enqueue_validation", lambda _settings, step: queued.append(step))

    async def at_step_one(_self: Scheduler) -> int:
        return 1

    monkeypatch.setattr(Scheduler, "trainer_step", at_step_one)
    await real_store.add_resources({"llm": {"kind": "llm", "model": "m", "model_version": "base"}}, resources_id="policy")
    settings = AlgorithmSettings(
        experiment=real_store.experiment, data_dir=tmp_path, metrics_file=tmp_path / "m.jsonl", n_samples=2,
        groups_per_step=1, max_inflight=4, total_steps=1, val_every=5, val_timeout_s=0.5,
    )
    summary = await Run(settings, TASKS, VAL).run(real_store)
    assert queued == [1]
    assert await RunProgress(real_store).next_validation() == 6
    assert summary["steps"] == 1 and summary["groups"] >= 1 and summary["final_val_accuracy"] == 0.0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 1
    await Run(settings, TASKS, VAL).run(real_store)
    assert queued == [1]  # version 1's pass is not queued twice


async def test_a_stopped_run_skips_the_final_validation(real_store: RedisStore, tmp_path: Path) -> None:
    """SIGTERM (`stop`) ends the loop with no final pass, says it stopped, and leaves the report of a
    run that had finished exactly as it was (issue 20, item 6)."""
    settings = AlgorithmSettings(experiment=real_store.experiment, data_dir=tmp_path, epochs=1, n_samples=2)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text('{"steps": 300, "final_val_accuracy": 0.95}')
    run = Run(settings, TASKS, VAL)
    run.stop()
    summary = await run.run(real_store)
    assert "final_val_accuracy" not in summary and summary["steps"] == 0 and summary["stopped"] is True
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"steps": 300, "final_val_accuracy": 0.95}
    assert not (tmp_path / "run" / "reward-curve.png").exists()
