"""`fulmen dev`: every service as a task of one process on the embedded Redis, on one's own tasks and
model. A demo through `fulmen dev` (the warm start in the process) is tests/test_tool_demo.py's run; that
the services learn the demo is the honcho run's claim (tests/test_demo_e2e.py, 60 steps)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from demo_runs import FULMEN, user_env

from fulmen.store.redis.embedded import free_port

pytestmark = pytest.mark.slow
TIMEOUT_S = 900  # ~20 s on a quiet 2-core machine; the slack is for a busy one


@pytest.mark.timeout(TIMEOUT_S)
def test_fulmen_dev_runs_ones_own_tasks_and_model(tmp_path: Path) -> None:
    """`fulmen dev --tasks FILE` with a model folder of one's own: the run names the policy, rollouts
    succeed, the trainer's versions are served, and the run ends by itself."""
    from fulmen.demo import arithmetic
    from fulmen.demo.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "my-model")
    tasks = arithmetic.write_jsonl(tmp_path / "tasks.jsonl", arithmetic.make_tasks("train", 40, seed=3))
    val = arithmetic.write_jsonl(tmp_path / "val.jsonl", arithmetic.make_tasks("val", 8, seed=3))
    env = user_env()
    env.update(FULMEN_MODEL_DIR=str(model), FULMEN_VAL_DATA=str(val), FULMEN_TOTAL_STEPS="2",
               FULMEN_GROUPS_PER_STEP="2", FULMEN_N_SAMPLES="4", FULMEN_REDIS_PORT=str(free_port()),
               FULMEN_PROXY_PORT=str(free_port()), FULMEN_TORCH_THREADS="1")
    done = subprocess.run([FULMEN, "dev", "--agent", "examples.arithmetic_agent:agent", "--tasks", str(tasks),
                           "--no-dashboard"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S - 60)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    assert "run finished: curve" in log and "now serving model version v2" in log, log[-6000:]
    assert "Writing model shards" not in log  # no progress bars in a service's log
    summary = json.loads((tmp_path / ".fulmen" / "run" / "default" / "summary.json").read_text())
    assert summary["steps"] >= 2
    # samples come only from succeeded rollouts: the rollouts found the policy the run named
    assert re.search(r"trainer: step 1 .* [1-9]\d* samples", log), log[-6000:]
