"""W&B in offline mode: the run files of a run and its restart, read back."""

from __future__ import annotations

from pathlib import Path

import pytest
import wandb_files
from tracker_runs import two_runs

from fulmen.store import RedisStore
from fulmen.telemetry.trackers.wandb import VAL_STEP, WandbTracker


async def test_a_run_and_its_restart_are_one_wandb_run(
    real_store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both processes' files carry the one run id; steps 1..6 once each; the passes against their own step."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_PROJECT": "fulmen-tests"}.items():
        monkeypatch.setenv(name, value)
    run_id = await two_runs(real_store, lambda: WandbTracker(tmp_path / "run"))
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # one per process, both of the one run: `wandb sync` sends them as one
    assert {i for f in files for i in wandb_files.run_ids(f)} == {run_id}
    rows = [row for f in files for row in wandb_files.history(f)]
    steps = [row["_step"] for row in rows if "loss/total" in row]
    assert steps == [1, 2, 3, 4, 5, 6]
    by_step = {row["_step"]: row for row in rows if "loss/total" in row}
    assert by_step[6]["loss/total"] == pytest.approx(1 / 6) and by_step[6]["comm/cosine"] == pytest.approx(0.99)
    assert {"loss/kl", "loss/entropy", "loss/clip_frac", "perf/tokens_per_s", "rollout/staleness_mean",
            "comm/bytes"} <= set(by_step[2])
    passes = [(row[VAL_STEP], row["val/accuracy"]) for row in rows if VAL_STEP in row]
    assert passes == [(0, 0.25), (5, 0.75)]
    assert any("rollouts/queuing" in row for row in rows)
    assert all(wandb_files.config(f)["objective"] == {"kl_coef": 0.1, "algorithm": "grpo"} for f in files)
