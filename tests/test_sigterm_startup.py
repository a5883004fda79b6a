"""Every service honours SIGTERM while it starts: stopped while it imports torch or its agent, or while
it waits for Redis, it exits 0 at once (it holds nothing yet), and a proxy so stopped never registers.

Each start-up step is made to last a minute (`tests/slow_import/sitecustomize.py` slows one import; a
Redis URL where nothing listens), so a service that waits for the step to end is caught, not timed."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from ops_helpers import FULMEN, ROOT, service_env
from procs import stop

from fulmen.store import RedisStore
from fulmen.store.redis.embedded import free_port

pytestmark = pytest.mark.slow
HONCHO_KILL_S = 5.0  # honcho's wait between SIGTERM and SIGKILL
UP_TIMEOUT_S = 60.0  # until the service is in the step under test
SLOW = ROOT / "tests" / "slow_import"


@dataclass
class Starting:
    name: str  # what the case is, for the messages
    args: list[str]
    step: str  # the stderr line that says the service is in the step
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None


def _cases(env: dict[str, str], tmp_path: Path) -> list[Starting]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # found: the service goes on to import torch
    slow_torch = {**env, "TEST_SLOW_IMPORT": "torch", "FULMEN_MODEL_DIR": str(model)}
    no_redis = {**env, "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    agents = f"{SLOW}:{ROOT}:{ROOT / 'tests' / 'runner'}"
    return [
        Starting("proxy importing torch", ["llm-proxy", "--backend", "torch", "--port", str(free_port())],
                 "slow import of torch", slow_torch),
        Starting("trainer importing torch", ["trainer"], "slow import of torch", slow_torch),
        Starting("runner importing its agent", ["runner", "--agent", "runner_test_agents:calls_llm"],
                 "slow import of runner_test_agents",
                 {**env, "TEST_SLOW_IMPORT": "runner_test_agents", "PYTHONPATH": agents}),
        Starting("runner waiting for Redis", ["runner", "--agent", "runner_test_agents:calls_llm"],
                 "waiting for Redis", {**no_redis, "PYTHONPATH": agents}),
        Starting("adapter waiting for Redis", ["adapter"], "waiting for Redis", no_redis),
        Starting("watchdog waiting for Redis", ["watchdog"], "waiting for Redis", no_redis),
    ]


def _start(case: Starting, folder: Path) -> None:
    case.log = folder / (case.name.replace(" ", "-") + ".log")
    with open(case.log, "wb") as out:
        case.process = subprocess.Popen([FULMEN, *case.args], env={**case.env, "PORT": str(free_port())}, cwd=ROOT,
                                        stdout=out, stderr=subprocess.STDOUT)


async def test_a_service_stopped_while_it_starts_exits_0_at_once(real_store: RedisStore, redis_url: str,
                                                                  tmp_path: Path) -> None:
    """Proxy and trainer importing torch, runner importing its agent, runner, adapter and watchdog
    waiting for Redis: SIGTERM in that step, and each exits 0 within 5 s; the proxy registered nothing."""
    env = service_env(redis_url, real_store.experiment, tmp_path, FULMEN_TORCH_THREADS="1",
                      PYTHONPATH=f"{SLOW}:{ROOT}", FULMEN_CHECKPOINT_DIR=str(tmp_path / "checkpoints"),
                      FULMEN_METRICS_FILE=str(tmp_path / "metrics.jsonl"))
    cases = _cases(env, tmp_path)
    for case in cases:
        _start(case, tmp_path)
    exits: dict[str, tuple[int | None, float]] = {}
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        waiting = list(cases)
        while waiting:
            for case in list(waiting):
                assert case.process is not None and case.log is not None
                text = case.log.read_text(errors="replace")
                assert case.process.poll() is None, f"{case.name} exited before SIGTERM:\n{text[-1500:]}"
                if case.step in text:
                    case.process.send_signal(signal.SIGTERM)
                    sent = time.monotonic()
                    try:
                        code: int | None = case.process.wait(HONCHO_KILL_S)
                    except subprocess.TimeoutExpired:
                        code = None
                    exits[case.name] = (code, round(time.monotonic() - sent, 2))
                    waiting.remove(case)
            assert time.monotonic() < deadline, "never reached the step: " + ", ".join(c.name for c in waiting)
            time.sleep(0.05)
    finally:
        stop([c.process for c in cases if c.process is not None], kill=[c.process for c in cases if c.process])
    print("exit status and seconds after SIGTERM:", exits)
    bad = {name: exit for name, exit in exits.items() if exit[0] != 0}
    assert bad == {}, f"{bad}\n" + "\n".join(f"--- {c.name}\n{c.log.read_text()[-1500:]}" for c in cases
                                             if c.name in bad and c.log)
    assert await real_store.registry.query_proxies(max_age_s=None) == []
