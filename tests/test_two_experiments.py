"""Two experiments at once on one Redis and in one working folder, each started by `honcho start`
on the repository's Procfile and .env, as the experiments guide says: a shared Redis (REDIS_URL), and
per experiment a second env file naming the experiment and its ports. Neither run reads the other's
checkpoints, metrics, validation passes or outputs; each ends by itself with its own step count."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from demo_runs import ROOT, user_env, write_env

from fulmen.store.redis.embedded import EmbeddedRedis, free_port

pytestmark = pytest.mark.slow
HONCHO = str(Path(sys.executable).with_name("honcho"))
STEPS = {"exp-a": 2, "exp-b": 4}  # different lengths: a crossed checkpoint or metrics file shows in the counts
TIMEOUT_S = 600


def _start(folder: Path, experiment: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`honcho start -e .env,<experiment>.env` in ``folder``, its log in <experiment>.log."""
    (folder / f"{experiment}.env").write_text("\n".join([
        f"FULMEN_EXPERIMENT={experiment}", f"FULMEN_PROXY_PORT={free_port()}", f"FULMEN_DASHBOARD_PORT={free_port()}",
        f"FULMEN_TOTAL_STEPS={STEPS[experiment]}", f"FULMEN_VAL_EVERY={STEPS[experiment]}",
    ]) + "\n")
    with open(folder / f"{experiment}.log", "w") as out:
        return subprocess.Popen([HONCHO, "start", "-e", f".env,{experiment}.env"], cwd=folder, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop(run: subprocess.Popen[bytes]) -> None:
    if run.poll() is None:
        os.killpg(run.pid, signal.SIGINT)
        try:
            run.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)


@pytest.mark.timeout(TIMEOUT_S)
def test_two_experiments_at_once_in_one_folder_keep_to_their_own(tmp_path: Path) -> None:
    """Both runs end by themselves; each one's checkpoints, metrics, validation jobs, summary and final
    model are its own, under its own name, with its own step count."""
    (tmp_path / "Procfile").write_text((ROOT / "Procfile").read_text())
    # the demo's settings, fewer and smaller steps; nothing per experiment in the shared .env
    write_env(tmp_path, ".env", {"FULMEN_GROUPS_PER_STEP": 4, "FULMEN_N_SAMPLES": 2,
                                 "FULMEN_SEED": 0})
    with EmbeddedRedis(tmp_path / "shared-redis", port=None) as server:
        env = {**user_env(), "REDIS_URL": server.url,
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        runs = {name: _start(tmp_path, name, env) for name in STEPS}
        try:
            codes = {name: run.wait(timeout=TIMEOUT_S - 60) for name, run in runs.items()}
        finally:
            for run in runs.values():
                _stop(run)
        logs = {name: (tmp_path / f"{name}.log").read_text() for name in STEPS}
        for name in STEPS:
            assert codes[name] == 0, f"{name}:\n{logs[name][-5000:]}"
            assert "run finished: curve" in logs[name], logs[name][-5000:]
        jobs = {k.decode() for k in redis.Redis.from_url(server.url).scan_iter("rq:job:val-*")}
    # one validation job per experiment and version, each experiment's own: the base and its last version
    assert jobs == {f"rq:job:val-{name}-v{v}" for name, steps in STEPS.items() for v in (0, steps)}, jobs
    data = tmp_path / ".fulmen"
    for name, steps in STEPS.items():
        other = next(n for n in STEPS if n != name)
        summary = json.loads((data / "run" / name / "summary.json").read_text())
        assert summary["steps"] == steps, summary
        assert Path(summary["metrics"]) == Path(".fulmen/run") / name / "trainer-metrics.jsonl"
        metrics = [json.loads(line) for line in (data / "run" / name / "trainer-metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == list(range(1, steps + 1))
        checkpoints = list((data / "checkpoints" / name).rglob("meta.json"))
        assert checkpoints, f"no checkpoint of {name}"
        assert {json.loads(p.read_text())["experiment"] for p in checkpoints} == {name}
        assert other not in logs[name].replace(f"{other}.env", ""), f"{name}'s log names {other}"
        labels = [v["label"] for v in summary["validations"]]
        # the pass the algorithm queued at the last step (val-<exp>-v<steps>, above) is in the summary when
        # the evaluator finished it before the final pass: on a busy machine it may
        assert labels in (["v0", "final"], ["v0", f"v{steps}", "final"]), f"{labels}\n{logs[name][-5000:]}"
        assert Path(tmp_path / summary["final_model"]).is_relative_to(tmp_path / ".fulmen" / "run" / name)
