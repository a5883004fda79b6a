"""A demo run as a user starts it in a fresh folder, for the end-to-end tests (test_dev_e2e.py,
test_tool_demo.py, test_demo_e2e.py): the repository's settings file with the test's overrides, the
user's environment, `fulmen dev` waited for with its log, and what the run's summary must show."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULMEN = str(Path(sys.executable).with_name("fulmen"))


def write_env(folder: Path, source: str, overrides: dict[str, object]) -> None:
    """``folder``/.env: the repository's ``source`` settings file with ``overrides`` in place of its own."""
    settings = [line for line in (ROOT / source).read_text().splitlines() if line.split("=", 1)[0] not in overrides]
    (folder / ".env").write_text("\n".join([*settings, *(f"{k}={v}" for k, v in overrides.items())]) + "\n")


def user_env() -> dict[str, str]:
    """The user's shell: no Redis, port or FULMEN_* of the test session; the examples importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_") and k not in ("REDIS_URL", "PORT")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def run_dev(folder: Path, env: dict[str, str], args: list[str], timeout_s: float) -> tuple[int, str]:
    """`fulmen dev *args` in ``folder`` until it ends (killed, with all it started, after ``timeout_s``):
    its exit code and log."""
    with open(folder / "dev.log", "w") as out:
        dev = subprocess.Popen([FULMEN, "dev", *args], cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        returncode = dev.wait(timeout=timeout_s)
    finally:
        if dev.poll() is None:
            os.killpg(dev.pid, signal.SIGKILL)
            dev.wait()
    return returncode, (folder / "dev.log").read_text()


def assert_beat_the_warm_start(folder: Path, steps: int, margin: float) -> None:
    """The summary of the run in ``folder``: ``steps`` steps or more, a warm start that left room to
    learn, a later validation ``margin`` above it (the best: held-out accuracy swings by ±0.1 from one
    pass to the next while it climbs, and greedy validation of an unchanged policy repeats its
    accuracy exactly, so a run that does not learn still fails), and the final model saved."""
    summary = json.loads((folder / ".fulmen" / "run" / "default" / "summary.json").read_text())
    accuracy = {v["label"]: v["accuracy"] for v in summary["validations"]}
    warm = accuracy["v0"]
    best = max([summary["final_val_accuracy"], *(a for label, a in accuracy.items() if label != "v0")])
    assert summary["steps"] >= steps
    assert warm <= 0.5, f"the warm start should leave room to learn: {accuracy}"
    assert best >= warm + margin, f"GRPO did not beat the warm start by {margin}: {accuracy}"
    assert Path(folder / summary["final_model"] / "model.safetensors").exists()
