"""`fulmen top` in a pseudo-terminal during a short run: it shows the queue depth, follows it as it
changes, lists the live services and draws the reward curve; `--once` prints one frame and exits."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest
from ops_helpers import FULMEN, service_env, start, stop

from fulmen.records import TrainStep
from fulmen.store import RedisStore
from fulmen.telemetry.steps import append_step

pytestmark = pytest.mark.slow
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


def _as_a_foreground_job() -> None:
    """In the child, before exec: the terminal becomes its controlling one, and Ctrl-C gets its
    default action back, as a shell gives a foreground job. A test run started in the background
    (`.ci/run &` from a script) inherits SIGINT ignored, and Python then never turns it into
    KeyboardInterrupt: `fulmen top` would draw on through every Ctrl-C."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Terminal:
    """A process on a pseudo-terminal of a fixed size; everything it drew, escapes removed."""

    def __init__(self, args: list[str], env: dict[str, str], rows: int = 60, cols: int = 120) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = {**env, "TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": str(rows)}
        # its own session with the terminal as its controlling one, so Ctrl-C on it is a SIGINT
        self.proc = subprocess.Popen(
            args, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
            preexec_fn=_as_a_foreground_job,
        )
        os.close(slave)
        self.master = master
        self.text = ""

    def read_until(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """Wait for ``pattern`` in what was drawn since the last match."""
        deadline = time.monotonic() + timeout_s
        start = len(self.text)
        while True:
            found = re.search(pattern, self.text[start:])
            if found:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{pattern!r} not shown within {timeout_s}s; last output:\n{self.text[-3000:]}")
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # the process closed the terminal
                    chunk = b""
                self.text += ANSI.sub("", chunk.decode(errors="replace"))

    def wait(self, timeout_s: float) -> int:
        """The exit code, reading what it draws meanwhile: a process writing to a full terminal (its last
        frame, the cursor restored on exit) blocks until someone reads, and would never exit."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"still running after {timeout_s}s; last output:\n{self.text[-3000:]}")
            ready, _, _ = select.select([self.master], [], [], min(left, 0.1))
            if ready:
                with contextlib.suppress(OSError):  # the process closed the terminal
                    self.text += ANSI.sub("", os.read(self.master, 65536).decode(errors="replace"))
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


async def _steps(store: RedisStore) -> None:
    for step, reward in enumerate([0.1, 0.5, 0.9], start=1):
        await append_step(store.redis, store.keys, TrainStep(step, f"v{step}", reward, -0.1, 8, time.time()))


async def test_top_shows_the_queue_depth_live(real_store: RedisStore, redis_url: str, tmp_path: Path) -> None:
    """7 queued rollouts read as queue depth 7, then 10 after 3 more; adapter and watchdog live; Ctrl-C exits 0."""
    env = service_env(redis_url, real_store.experiment, tmp_path)
    services = [start(["adapter"], env), start(["watchdog"], env)]
    term = None
    try:
        for i in range(7):  # no runner: the depth stays what was queued
            await real_store.rollouts.enqueue_rollout({"q": i}, rollout_id=f"r{i}")
        await _steps(real_store)
        term = Terminal([FULMEN, "top", "--interval", "0.5"], env)
        depth = term.read_until(r"queue depth\W+(\d+)", 30)
        assert depth.group(1) == "7"
        # the services come up while top runs: one adapter and one watchdog, from their heartbeats
        term.read_until(r"adapter\W+1\W.*\n(?:.*\n)*?.*watchdog\W+1\W", 60)
        term.read_until("reward over the last 3 steps +▁▅█ +step 3", 10)
        for i in range(7, 10):
            await real_store.rollouts.enqueue_rollout({"q": i}, rollout_id=f"r{i}")
        assert term.read_until(r"queue depth\W+(10)\W", 15).group(1) == "10"
        os.write(term.master, b"\x03")  # Ctrl-C
        assert term.wait(15) == 0
    finally:
        if term is not None:
            term.close()
        stop(services)


async def test_top_once_prints_one_frame(real_store: RedisStore, redis_url: str, tmp_path: Path) -> None:
    """--once prints the queue depth, the curve and the model version, then exits 0."""
    for i in range(4):
        await real_store.rollouts.enqueue_rollout({"q": i}, rollout_id=f"r{i}")
    await _steps(real_store)
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny", "model_version": "v3"}}, resources_id="policy")
    # the adapter's counters of reward per served version (rollback, A/B): a mean below 0 included
    await real_store.redis.hset(real_store.keys.adapter_stats, mapping={
        "version:train:v2:rollouts": 2, "version:train:v2:reward_u": -1_000_000,
        "version:train:v3:rollouts": 4, "version:train:v3:reward_u": 3_000_000})
    env = service_env(redis_url, real_store.experiment, tmp_path)
    done = subprocess.run([FULMEN, "top", "--once"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"queue depth\W+4\W", done.stdout), done.stdout
    assert "model version v3" in done.stdout
    assert "▁▅█" in done.stdout
    assert re.search(r"train reward by version\W+v2 -0\.50, v3 0\.75", done.stdout), done.stdout


def test_top_says_when_redis_is_unreachable(tmp_path: Path) -> None:
    """--once with nothing at REDIS_URL: exit 1 and a clear line, no password shown."""
    from fulmen.store.redis.embedded import free_port

    env = {**os.environ, "REDIS_URL": f"redis://u:s3cret@127.0.0.1:{free_port()}/0"}
    env.pop("PORT", None)
    done = subprocess.run([FULMEN, "top", "--once"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "unreachable" in done.stderr and "s3cret" not in done.stderr + done.stdout
