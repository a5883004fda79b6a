"""Every long-running service exits within 5 s of SIGTERM once up and idle (honcho SIGKILLs after 5 s).

All start at once against the test's Redis, as under `honcho start`; once each is up (its readiness
probe answers) and has idled a moment, all get SIGTERM together, as when honcho stops.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from ops_helpers import FULMEN, ROOT, get, service_env
from procs import stop

from fulmen.embedded import free_port
from fulmen.store import RedisStore
from fulmen.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow
HONCHO_KILL_S = 5.0  # honcho's wait between SIGTERM and SIGKILL
UP_TIMEOUT_S = 120.0  # two torch processes importing at once on a busy machine
IDLE_S = 2.0  # up and idle: each service's loop has gone round a few times


@dataclass
class Service:
    name: str
    args: list[str]
    port: int  # where its readiness probe answers
    probe: str = "/readyz"
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def up(self) -> bool:
        return get(self.port, self.probe, timeout_s=1.0)[0] == 200


def _services(tmp_path: Path, model: Path) -> list[Service]:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                             for i in range(4)))
    proxy_port = free_port()
    return [
        Service("trainer", ["trainer"], free_port()),
        Service("llm-proxy", ["llm-proxy", "--backend", "torch", "--port", str(proxy_port)], proxy_port),
        Service("adapter", ["adapter"], free_port()),
        Service("runner", ["runner", "--agent", "examples.arithmetic_agent:agent", "--concurrency", "4"], free_port()),
        Service("watchdog", ["watchdog"], free_port()),
        Service("evaluator", ["evaluator"], free_port()),
        Service("dashboard", ["dashboard"], free_port(), probe="/healthz"),
        Service("algorithm", ["algorithm", "--train-data", str(tasks), "--total-steps", "50"], free_port()),
    ]


def _wait(check: Callable[[], bool], procs: list[Service], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        dead = [s.name for s in procs if s.process is not None and s.process.poll() is not None]
        assert not dead, f"exited before SIGTERM: {dead}: " + _tails(procs, dead)
        assert time.monotonic() < deadline, "not up in time: " + _tails(procs, [s.name for s in procs if not s.up()])
        time.sleep(0.3)


def _tails(procs: list[Service], names: list[str]) -> str:
    return "\n".join(f"--- {s.name}\n{s.log.read_text()[-1500:]}" for s in procs if s.name in names and s.log)


def test_every_service_exits_within_5_s_of_sigterm_when_idle(
    real_store: RedisStore, redis_url: str, tmp_path: Path
) -> None:
    """trainer, torch proxy, adapter, runner, watchdog, evaluator, dashboard and algorithm, up and idle,
    each exit within 5 s of one SIGTERM to all of them, with status 0."""
    model = build_tiny_model(tmp_path / "tiny")
    services = _services(tmp_path, model)
    env = service_env(redis_url, real_store.experiment, tmp_path, FULMEN_MODEL_DIR=str(model),
                      FULMEN_CHECKPOINT_DIR=str(tmp_path / "checkpoints"),
                      FULMEN_METRICS_FILE=str(tmp_path / "metrics.jsonl"), FULMEN_TORCH_THREADS="1")
    for s in services:
        s.log = tmp_path / f"{s.name}.log"
        port_env = {"FULMEN_DASHBOARD_PORT": str(s.port)} if s.name == "dashboard" else {"PORT": str(s.port)}
        if s.name == "algorithm":  # its rollouts in an experiment of their own: the others stay idle
            port_env["FULMEN_EXPERIMENT"] = real_store.experiment + "-run"
        with open(s.log, "wb") as out:
            s.process = subprocess.Popen([FULMEN, *s.args], env={**env, **port_env}, cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT)
    procs = [s.process for s in services if s.process is not None]
    try:
        _wait(lambda: all(s.up() for s in services), services, UP_TIMEOUT_S)
        time.sleep(IDLE_S)
        sent = time.monotonic()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        took: dict[str, float] = {}
        codes: dict[str, int | None] = {}
        for s in services:
            assert s.process is not None
            try:
                codes[s.name] = s.process.wait(timeout=max(0.1, sent + HONCHO_KILL_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[s.name] = None
            took[s.name] = round(time.monotonic() - sent, 2)
        print("seconds from SIGTERM to exit (at most):", took)
        late = {name: took[name] for name, code in codes.items() if code is None}
        assert late == {}, f"still running {HONCHO_KILL_S} s after SIGTERM: {late}\n" + _tails(services, list(late))
        unclean = {name: code for name, code in codes.items() if code != 0}
        assert unclean == {}, f"exit statuses {unclean}\n" + _tails(services, list(unclean))
    finally:
        stop(procs, kill=procs)
