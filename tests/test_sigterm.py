"""Every long-running service exits within 5 s of SIGTERM, as `honcho start` stops them (SIGKILL after
5 s): idle ones at once, busy ones within their grace, and a trainer or proxy still loading at once.

All start together on the test's Redis; once up, the proxy gets hundreds of calls, the runner agents
that run for minutes and the evaluator a validation pass; then one SIGTERM to all, as honcho sends it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from ops_helpers import FULMEN, ROOT, get, service_env
from procs import stop

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records.status import RolloutStatus
from fulmen.settings import AlgorithmSettings
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import free_port
from fulmen_algorithm.jobs import enqueue_validation, validation_job_id, validation_queue
from fulmen_algorithm.validation import requeue_abandoned

if TYPE_CHECKING:
    from rq import Queue

pytestmark = pytest.mark.slow
HONCHO_KILL_S = 5.0  # honcho's wait between SIGTERM and SIGKILL
UP_TIMEOUT_S = 120.0  # two torch processes importing at once on a busy machine
IDLE_S = 1.0  # up and idle: each service's loop has gone round
CALLS = 300  # concurrent calls: the tiny model's proxy is still generating when its grace runs out
AGENTS = 4  # runner_test_agents:slow rollouts of 10 minutes
# The runner's grace (default 3 s) less a second: its hand-back then has 3 s, not 2, on a machine that
# other tests share with these eight processes and their Redis
RUNNER_GRACE_S = 2.0


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



def _services(tmp_path: Path) -> list[Service]:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                             for i in range(4)))
    proxy_port = free_port()
    return [
        Service("trainer", ["trainer"], free_port()),
        Service("llm-proxy", ["llm-proxy", "--backend", "torch", "--port", str(proxy_port)], proxy_port),
        Service("adapter", ["adapter"], free_port()),
        Service("runner", ["runner", "--agent", "runner_test_agents:slow", "--concurrency", str(AGENTS),
                           "--grace-s", str(RUNNER_GRACE_S)], free_port()),
        Service("watchdog", ["watchdog"], free_port()),
        Service("evaluator", ["evaluator"], free_port()),
        Service("dashboard", ["dashboard"], free_port(), probe="/healthz"),
        Service("algorithm", ["algorithm", "--train-data", str(tasks), "--total-steps", "50"], free_port()),
    ]


def _start(services: list[Service], env: dict[str, str], folder: Path, experiment: str) -> None:
    folder.mkdir(exist_ok=True)
    for s in services:
        s.log = folder / f"{s.name}.log"
        own = {"FULMEN_DASHBOARD_PORT": str(s.port)} if s.name == "dashboard" else {"PORT": str(s.port)}
        own["FULMEN_EXPERIMENT"] = experiment
        if s.name == "algorithm":  # its rollouts in an experiment of their own: the runner's stay the test's
            own["FULMEN_EXPERIMENT"] = experiment + "-run"
        with open(s.log, "wb") as out:
            s.process = subprocess.Popen([FULMEN, *s.args], env={**env, **own}, cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT)


def _wait(check: Callable[[], bool], services: list[Service], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        dead = [s.name for s in services if s.process is not None and s.process.poll() is not None]
        assert not dead, f"exited before SIGTERM: {dead}: " + _tails(services, dead)
        assert time.monotonic() < deadline, "not up in time: " + _tails(services, [s.name for s in services
                                                                                   if not s.up()])
        time.sleep(0.3)


def _exits(services: list[Service], since: float, timeout_s: float) -> dict[str, tuple[int, float] | None]:
    """Per service, its exit status and the seconds from ``since`` (monotonic) to its exit, or None if
    it still runs ``timeout_s`` after ``since``."""
    exits: dict[str, tuple[int, float] | None] = {}
    while len(exits) < len(services) and time.monotonic() < since + timeout_s:
        for s in services:
            code = s.process.poll() if s.process is not None else None
            if s.name not in exits and code is not None:
                exits[s.name] = (code, round(time.monotonic() - since, 2))
        time.sleep(0.05)
    return {s.name: exits.get(s.name) for s in services}


def _tails(services: list[Service], names: list[str]) -> str:
    return "\n".join(f"--- {s.name}\n{s.log.read_text()[-1500:]}" for s in services if s.name in names and s.log)


def _calls(port: int, n: int) -> list[object]:
    """``n`` completions sent at once, each from its thread; their outcomes (a status, or an error)
    land in the returned list as they end."""
    ended: list[object] = []
    body = json.dumps({"model": "tiny", "prompt": "1+1=", "max_tokens": 400, "temperature": 1.0}).encode()

    def call() -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                ended.append(reply.status)
        except OSError as e:
            ended.append(type(e).__name__)

    for _ in range(n):
        threading.Thread(target=call, daemon=True).start()
    return ended


def _stop_while_loading(env: dict[str, str], tmp_path: Path, experiment: str) -> None:
    """A second trainer and a second torch proxy (another experiment's), each SIGTERMed while it loads
    the model (seconds): each exits 0 at once, not once the load is done."""
    proxy_port = free_port()
    trainer = Service("trainer", ["trainer"], free_port(), probe="/healthz")
    proxy = Service("llm-proxy", ["llm-proxy", "--backend", "torch", "--port", str(proxy_port)], proxy_port)
    # when each has begun to load: the trainer's ops server is up (its setup starts), the proxy's
    # lifespan has started (its engine loads), and neither says it is done
    loading = {"trainer": "/healthz /readyz /metrics", "llm-proxy": "Waiting for application startup"}
    done = {"trainer": "stopped at step", "llm-proxy": "serving tiny"}
    _start([trainer, proxy], env, tmp_path / "loading", experiment + "-loading")
    waiting = [trainer, proxy]
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while waiting:
            for s in list(waiting):
                assert s.process is not None and s.log is not None
                if loading[s.name] in s.log.read_text():
                    s.process.send_signal(signal.SIGTERM)
                    sent = time.monotonic()
                    exits = _exits([s], sent, HONCHO_KILL_S)
                    log = s.log.read_text()
                    assert exits[s.name] is not None and exits[s.name][0] == 0, (exits, log[-1500:])
                    assert exits[s.name][1] < 2.0 and done[s.name] not in log, (exits, log[-1500:])
                    waiting.remove(s)
            assert time.monotonic() < deadline, "never began to load: " + _tails(waiting, [s.name for s in waiting])
            time.sleep(0.05)
    finally:
        stop([s.process for s in (trainer, proxy) if s.process is not None], kill=[])


def _busy_evaluator(experiment: str, redis_url: str, tmp_path: Path) -> Queue:
    """A validation pass for the evaluator, which waits on its rollouts (the runner's slots are all
    taken): returns the eval queue once the pass has started."""
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"id": "v1", "question": "1+1=", "answer": "2"}) + "\n")
    settings = AlgorithmSettings(experiment=experiment, redis_url=redis_url, val_data=val, val_timeout_s=600)
    enqueue_validation(settings, 1)
    queue = validation_queue(settings)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while queue.started_job_registry.count == 0:
        assert time.monotonic() < deadline, "the evaluator did not start the pass"
        time.sleep(0.1)
    return queue


async def test_every_service_exits_within_5_s_of_sigterm(real_store: RedisStore, redis_url: str, tmp_path: Path) -> None:
    """trainer, adapter, watchdog, dashboard and algorithm idle, the torch proxy generating for hundreds of
    calls, the runner running agents and the evaluator in a validation pass: one SIGTERM to all, and each
    exits 0 within 5 s; the runner hands its attempts back, the pass is left for the next evaluator. Before that, a trainer and a proxy stopped while loading exit at once."""
    model = build_tiny_model(tmp_path / "tiny")
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny", "model_version": "base"}},
                                   resources_id="policy")  # what a validation pass serves
    env = service_env(redis_url, real_store.experiment, tmp_path, FULMEN_MODEL_DIR=str(model),
                      FULMEN_CHECKPOINT_DIR=str(tmp_path / "checkpoints"), FULMEN_TORCH_THREADS="1",
                      FULMEN_METRICS_FILE=str(tmp_path / "metrics.jsonl"),
                      PYTHONPATH=f"{ROOT}:{ROOT / 'tests' / 'runner'}")  # runner_test_agents
    services = _services(tmp_path)
    _start(services, env, tmp_path, real_store.experiment)
    procs = [s.process for s in services if s.process is not None]
    try:
        await asyncio.to_thread(_wait, lambda: all(s.up() for s in services), services, UP_TIMEOUT_S)
        await asyncio.to_thread(_stop_while_loading, env, tmp_path, real_store.experiment)
        ids = [(await real_store.rollouts.enqueue_rollout({"sleep_s": 600}, mode="train")).rollout_id for _ in range(AGENTS)]
        while any(r.status is not RolloutStatus.RUNNING for r in await real_store.rollouts.get_rollouts(ids)):
            await asyncio.sleep(0.1)
        queue = await asyncio.to_thread(_busy_evaluator, real_store.experiment, redis_url, tmp_path)
        ended = _calls(services[1].port, CALLS)
        await asyncio.sleep(IDLE_S)  # the proxy is generating, the others idle
        sent = time.monotonic()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        in_flight = CALLS - len(ended)
        exits = await asyncio.to_thread(_exits, services, sent, HONCHO_KILL_S)
        print("exit status and seconds after SIGTERM:", exits)
        assert in_flight > 0, "the proxy was not busy at SIGTERM"
        late = [name for name, exit in exits.items() if exit is None]
        assert late == [], f"still running {HONCHO_KILL_S} s after SIGTERM: {late} ({exits})\n" + _tails(services, late)
        unclean = [name for name, exit in exits.items() if exit is not None and exit[0] != 0]
        assert unclean == [], f"exit statuses and seconds {exits}\n" + _tails(services, unclean)
        assert {r.status for r in await real_store.rollouts.get_rollouts(ids)} == {RolloutStatus.REQUEUING}
        # the pass the evaluator left: the next one runs it
        assert requeue_abandoned(queue) == [validation_job_id(real_store.experiment, 1)]
    finally:
        stop(procs, kill=procs)

