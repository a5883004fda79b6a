"""trackio: its local store after a run and its restart, read back with trackio's own storage."""

from __future__ import annotations

from pathlib import Path

import pytest
from tracker_runs import two_runs

from fulmen.store import RedisStore
from fulmen.telemetry.trackers.trackio import TrackioTracker


async def test_a_run_and_its_restart_are_one_trackio_run(
    real_store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run in the project; the steps 1..6 once each; the passes at the steps they validated."""
    from trackio.sqlite_storage import SQLiteStorage

    project = f"fulmen-tests-{real_store.experiment}"
    monkeypatch.setenv("TRACKIO_PROJECT", project)
    run_id = await two_runs(real_store, lambda: TrackioTracker(tmp_path))
    assert SQLiteStorage.get_runs(project) == [run_id]
    logs = SQLiteStorage.get_logs(project, run_id)
    train = [row for row in logs if "loss/total" in row]
    assert [row["step"] for row in train] == [1, 2, 3, 4, 5, 6]
    assert train[-1]["loss/total"] == pytest.approx(1 / 6) and train[-1]["comm/cosine"] == pytest.approx(0.99)
    assert {"loss/kl", "loss/entropy", "loss/clip_frac", "perf/tokens_per_s", "rollout/staleness_mean"} <= set(train[0])
    assert [(row["step"], row["val/accuracy"]) for row in logs if "val/accuracy" in row] == [(0, 0.25), (5, 0.75)]
    assert any("rollouts/queuing" in row for row in logs)
    assert SQLiteStorage.get_run_config(project, run_id)["objective"]["kl_coef"] == 0.1
