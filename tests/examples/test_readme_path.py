"""Your own agent, exactly as the README's tour says, with each framework: `fulmen redis`, `fulmen
run-once` (serving the tiny model itself, or on a running `fulmen llm-proxy`), then `fulmen train` on
16 tasks; checked with `fulmen rollouts` and `fulmen export`. Every step is a `fulmen` command run as a
user runs it (from their own folder, the agent on PYTHONPATH); nothing is set up from Python.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fulmen.store.redis.embedded import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FULMEN = str(Path(sys.executable).with_name("fulmen"))
TASKS = REPO / "examples" / "tasks.jsonl"
TASK = '{"question": "What is 17 * 23?", "answer": 391}'
STEPS = 2
# agent, module it needs, the API it calls
FRAMEWORKS = {
    "openai": ("examples.single_turn_agent:agent", "openai"),
    "langgraph": ("examples.langgraph.agent:agent", "langgraph"),
    "agents-responses": ("examples.openai_agents.agent:agent", "agents"),
    "agents-chat": ("examples.openai_agents.agent:chat_agent", "agents"),
    "autogen": ("examples.autogen.agent:agent", "autogen_agentchat"),
    "anthropic": ("examples.anthropic.agent:agent", "anthropic"),
}


class User:
    """A user's shell: their own folder, the agent importable, the embedded Redis on its own port."""

    def __init__(self, home: Path, redis_port: int) -> None:
        self.home = home
        env = {n: v for n, v in os.environ.items() if not n.startswith(("FULMEN_", "OTEL_")) and n != "REDIS_URL"}
        self.env = {**env, "FULMEN_REDIS_PORT": str(redis_port), "PYTHONPATH": str(REPO), "COLUMNS": "200"}

    def folder(self, name: str) -> Path:
        path = self.home / name
        path.mkdir(exist_ok=True)
        return path

    def run(self, cwd: Path, *args: str, timeout_s: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([FULMEN, *args], cwd=cwd, env={**self.env, **env}, capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
        return done

    def start(self, cwd: Path, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([FULMEN, *args], cwd=cwd, env=self.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def _stop(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> Iterator[User]:
    """`fulmen redis` kept up, as the tour starts (run-once and train would start it themselves)."""
    the_user = User(tmp_path_factory.mktemp("user"), free_port())
    redis = the_user.start(the_user.home, "redis")
    try:
        ping = the_user.run(the_user.home, "status", timeout_s=60)
        assert ping.returncode == 0, ping.stderr
        yield the_user
    finally:
        _stop(redis)


def _wait_registered(user: User, port: int, proxy: subprocess.Popen[str], timeout_s: float = 120) -> None:
    """Until the proxy is in the store's registry (read only: what the runners see)."""
    import redis

    from fulmen.keys import Keys

    client = redis.Redis(port=int(user.env["FULMEN_REDIS_PORT"]))
    deadline = time.monotonic() + timeout_s
    while not any(f":{port}".encode() in v for v in client.hgetall(Keys("default").proxies).values()):
        assert proxy.poll() is None, proxy.stderr.read() if proxy.stderr else "the proxy exited"
        assert time.monotonic() < deadline, "the proxy did not register"
        time.sleep(0.5)
    client.close()


def _needs(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed: pip install -e '.[dev]' (the frameworks extra)")


def _assert_recorded_call(done: subprocess.CompletedProcess[str]) -> None:
    """run-once's output: a succeeded rollout and at least one LLM call with its token ids."""
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    assert "response token ids: [" in done.stdout, done.stdout
    assert "prompt +" in done.stdout and "response tokens" in done.stdout
    assert "made no LLM call" not in done.stderr


def test_run_once_with_nothing_running_serves_the_tiny_model_itself(tmp_path: Path) -> None:
    """On a fresh folder with no Redis and no proxy, run-once starts both, records the call, stops both."""
    _needs("openai")
    the_user = User(tmp_path, free_port())
    done = the_user.run(tmp_path, "run-once", "--agent", FRAMEWORKS["openai"][0], "--task", TASK)
    _assert_recorded_call(done)
    assert "started the embedded one" in done.stderr
    assert "serving" in done.stderr and "tiny-model" in done.stderr
    assert (tmp_path / ".fulmen" / "tiny-model" / "config.json").is_file()


def test_an_agent_that_calls_no_model_is_told_why(user: User, running_proxy: None) -> None:
    """run-once says loudly when the agent made no recorded LLM call, and why that usually happens."""
    cwd = user.folder("no-call")
    (cwd / "silent_agent.py").write_text("import fulmen\n\n@fulmen.rollout\ndef agent(task, llm):\n    return 1.0\n")
    done = user.run(cwd, "run-once", "--agent", "silent_agent:agent", "--task", TASK, "-e", "no-call",
                    PYTHONPATH=str(cwd))
    assert done.returncode == 0, done.stderr
    assert "made no LLM call that Fulmen recorded" in done.stderr
    assert "base_url=llm.base_url" in done.stderr


@pytest.fixture(scope="module")
def running_proxy(user: User) -> Iterator[None]:
    """`fulmen llm-proxy` (the tiny model) and `fulmen serve`, as the tour's "keep a proxy up" step."""
    cwd = user.folder("proxy")
    port = free_port()
    proxy = user.start(cwd, "llm-proxy", "--port", str(port))  # no --model-dir: the tiny model, built here
    try:
        _wait_registered(user, port, proxy)
        served = user.run(cwd, "serve", "--model-dir", ".fulmen/tiny-model")
        assert served.returncode == 0 and "agents call model tiny-model" in served.stdout, served.stderr
        yield None
    finally:
        _stop(proxy)


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_framework_agent_through_the_readme_commands(framework: str, user: User, running_proxy: None) -> None:
    """run-once prints a recorded call with token ids; `fulmen train` on 16 tasks trains STEPS steps,
    publishes a version, and every train rollout gave samples with token ids."""
    agent, module = FRAMEWORKS[framework]
    _needs(module)
    cwd = user.folder(framework)
    once = user.run(cwd, "run-once", "--agent", agent, "--task", TASK)
    _assert_recorded_call(once)
    assert "serving" not in once.stderr  # the running proxy answered: run-once served nothing itself

    trained = user.run(cwd, "train", "--agent", agent, "--tasks", str(TASKS), "--total-steps", str(STEPS),
                       "--n-samples", "2", "--groups-per-step", "2", "--no-dashboard", "-e", framework,
                       timeout_s=600)
    assert trained.returncode == 0, trained.stderr[-6000:]
    assert f"trained {STEPS} step(s)" in trained.stdout, trained.stdout
    assert f"(version v{STEPS})" in trained.stdout
    assert (cwd / ".fulmen" / "run" / framework / "final-model" / "config.json").is_file()

    listed = user.run(cwd, "rollouts", "--json", "--limit", "1000", "-e", framework)
    assert listed.returncode == 0, listed.stderr
    rollouts = [r for r in json.loads(listed.stdout) if r.get("mode") == "train" and r["status"] == "succeeded"]
    assert len(rollouts) >= STEPS * 2 * 2
    exported = user.run(cwd, "export", "samples.jsonl", "--token-ids", "-e", framework)
    assert exported.returncode == 0, exported.stderr
    samples = [json.loads(line) for line in (cwd / "samples.jsonl").read_text().splitlines()]
    assert all(s["response_token_ids"] and s["prompt_token_ids"] for s in samples)
    assert {r["rollout_id"] for r in rollouts} <= {s["rollout_id"] for s in samples}
