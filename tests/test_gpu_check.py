"""bench/gpu_check.sh --dry-run: its first steps run on the CPU and report "ok", as the GPU run will."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_the_dry_run_of_the_gpu_check_passes_its_first_steps(tmp_path: Path) -> None:
    """The trainer's step (full fine-tuning) and the proxy engine against generate, on tiny shapes:
    each step "ok", the last stdout line the summary, the figures in gpu_check.json and .md."""
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path),
                           "--only", "b_full,d"], capture_output=True, text=True, timeout=840,
                          env={**os.environ, "GPU_CHECK_PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["dry_run"] is True
    assert summary["steps"] == {"b_full": "ok", "d": "ok"}, (tmp_path / "steps.log").read_text()[-3000:]
    details = json.loads((tmp_path / "gpu_check.json").read_text())["details"]
    assert details["b_full"]["result"]["tokens_per_s"] > 0
    assert details["d"]["result"]["engine_tokens_per_s_c32"] > 0
    assert "| b_full | ok |" in (tmp_path / "gpu_check.md").read_text()
