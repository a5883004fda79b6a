"""The demo, shortened, exactly as a user starts it: `honcho start` on the repository's Procfile and
.env (embedded Redis, proxy, runner, adapter, trainer, evaluator and `fulmen demo`), with fewer
trainer steps. It must learn: validation accuracy during the GRPO steps beats the warm start.

Only what cannot be shared with another run is changed: free ports for Redis, the proxy and the
dashboard, a temporary working folder, and the number of steps."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from demo_runs import ROOT, assert_beat_the_warm_start, write_env

from fulmen.store.redis.embedded import free_port

pytestmark = pytest.mark.slow
HONCHO = str(Path(sys.executable).with_name("honcho"))
STEPS = 200
# Warm start 0.40 (seed 0). Runs differ a lot at a given step early on: at step 100, 0.54–0.72 in
# earlier runs, but 0.44–0.46 in three runs on 2026-12-02 (one in CI, two alone, today's code and the
# commit before it), passes 25 steps apart reading 0.34–0.41 before that; bench/recipes.py's seed-0
# curve swings 0.74 → 0.58 → 0.76 between passes 20 steps apart, and is above 0.8 from step 200. So
# 200 steps, a pass every VAL_EVERY, and the best pass must beat the warm start by MARGIN. Alone, 200
# steps read 0.73; in a CI run beside the other tests only 0.48 (the demo learns less per step on a
# loaded machine, not yet understood): a margin of 0.05, which an unchanged policy (greedy validation
# repeats its accuracy) still cannot meet.
MARGIN = 0.05
VAL_EVERY = 50
TIMEOUT_S = 900  # ~4 min on a quiet 2-core machine; the slack is for a busy one


@pytest.mark.timeout(TIMEOUT_S)
def test_shortened_demo_through_honcho_beats_the_warm_start(tmp_path: Path) -> None:
    """`honcho start` with STEPS trainer steps: ends by itself, reports, and validation rose by MARGIN
    (at its best pass)."""
    shutil.copy(ROOT / "Procfile", tmp_path / "Procfile")
    overrides = {
        "FULMEN_REDIS_PORT": free_port(), "FULMEN_PROXY_PORT": free_port(), "FULMEN_METRICS_PORT": 0,
        "FULMEN_DASHBOARD_PORT": free_port(),
        "FULMEN_TOTAL_STEPS": STEPS, "FULMEN_VAL_EVERY": VAL_EVERY, "FULMEN_SEED": 0,
    }
    write_env(tmp_path, ".env", overrides)
    # the user's shell: no Redis of theirs, no FULMEN_* of the test session; the agent's module importable
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    # the Procfile runs `fulmen`: this venv's, even when pytest was started without activating it
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with open(tmp_path / "honcho.log", "w") as out:
        honcho = subprocess.Popen([HONCHO, "start"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        returncode = honcho.wait(timeout=TIMEOUT_S - 60)
    finally:  # whatever happens, no service outlives the test
        if honcho.poll() is None:
            os.killpg(honcho.pid, signal.SIGINT)
            try:
                honcho.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(honcho.pid, signal.SIGKILL)
    log = (tmp_path / "honcho.log").read_text()
    assert returncode == 0, log[-6000:]
    assert "run finished: curve" in log, log[-6000:]
    assert_beat_the_warm_start(tmp_path, STEPS, MARGIN)
