"""bench/convergence_parity.py at toy size: records, replays through 2 ranks per config, reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "convergence_parity.py"


@pytest.mark.slow
def test_convergence_parity_bench_runs_at_toy_size(tmp_path: Path) -> None:
    """A smoke run (4 SFT steps, 2 replay steps, 1 seed): the stream is recorded and cached, both
    configs replay on 2 ranks that end with equal weights, the last line is the JSON report. (The
    gap itself is measured by the full bench: a policy this untrained earns no reward to compare.)"""
    args = [sys.executable, str(BENCH), "--steps", "2", "--groups-per-step", "2", "--seeds", "0", "--val", "20",
            "--warm-until", "0", "--cache", str(tmp_path / "cache"), "--threads", "1"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert report["steps"] == 2 and report["seeds"] == [0] and report["val_tasks"] == 20
    assert len(report["reward_none"]) == len(report["reward_topk1"]) == 1
    assert report["reward_gap"] == pytest.approx(abs(report["reward_none_mean"] - report["reward_topk1_mean"]),
                                                 abs=1e-3)
    assert (tmp_path / "cache" / "stream.msgpack").exists()
    assert "recorded 4 groups" in first.stderr
