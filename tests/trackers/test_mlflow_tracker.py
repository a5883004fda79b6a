"""MLflow: a local file store written by a run and its restart, read back with MlflowClient."""

from __future__ import annotations

from pathlib import Path

import pytest
from tracker_runs import two_runs

from fulmen.store import RedisStore
from fulmen.telemetry.trackers.mlflow import FOLDER, RUN_TAG, MlflowTracker


async def test_a_run_and_its_restart_are_one_mlflow_run(
    real_store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run, found again by its tag; every metric's history has steps 1..6 once; the settings as params."""
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default: a file store in the run folder
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "fulmen-tests")
    run_id = await two_runs(real_store, lambda: MlflowTracker(tmp_path))
    client = MlflowClient(tracking_uri=(tmp_path / FOLDER).as_uri())
    experiment = client.get_experiment_by_name("fulmen-tests")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.data.tags[RUN_TAG] == run_id and run.info.run_name == real_store.experiment
    assert run.info.status == "FINISHED"
    loss = client.get_metric_history(run.info.run_id, "loss/total")
    assert [(m.step, round(m.value, 4)) for m in loss] == [(s, round(1 / s, 4)) for s in range(1, 7)]
    for key in ("loss/kl", "loss/entropy", "loss/clip_frac", "rollout/reward_mean", "perf/tokens_per_s",
                "comm/bytes", "comm/cosine"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2, 3, 4, 5, 6], key
    accuracy = client.get_metric_history(run.info.run_id, "val/accuracy")
    assert [(m.step, m.value) for m in accuracy] == [(0, 0.25), (5, 0.75)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "val/pass_at_4")] == [1.0]
    assert "rollouts/succeeded" in run.data.metrics
    assert run.data.params["objective.kl_coef"] == "0.1" and run.data.params["run.seed"] == "3"
