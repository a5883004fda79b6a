"""Real `fulmen` commands as child processes, for the runner's end-to-end tests.

`FulmenProcesses.start("runner", "--agent", ...)` runs the console script `fulmen` from the venv with a
clean environment (REDIS_URL, FULMEN_EXPERIMENT, PYTHONPATH=tests/runner, no stray FULMEN_* or OTEL_*
variable from the test's own shell), its stdout and stderr kept in files; every child still alive is
killed when the context ends. Patterns follow tests/store/workers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from fulmen.store import RedisStore

RUNNER_TESTS = Path(__file__).resolve().parent
REPO = RUNNER_TESTS.parents[1]
FULMEN = str(Path(sys.executable).with_name("fulmen"))


def child_env(redis_url: str, experiment: str, **extra: str) -> dict[str, str]:
    """The environment of a `fulmen` child: ours minus anything that configures Fulmen or OTel."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("FULMEN_", "OTEL_")) and name != "REDIS_URL"
    }
    env.update(
        REDIS_URL=redis_url,
        FULMEN_EXPERIMENT=experiment,
        FULMEN_LOG_LEVEL="INFO",
        PYTHONPATH=str(RUNNER_TESTS),
        COLUMNS="200",
        PYTHONFAULTHANDLER="1",  # a child that hangs shows where (see `FulmenProcess.wait`)  # rich wraps at 80 columns when not on a terminal: keep messages on one line
    )
    env.update(extra)
    return env


class FulmenProcess:
    """One `fulmen <command>` child, seen from the test."""

    def __init__(self, process: asyncio.subprocess.Process, stdout_path: Path, stderr_path: Path) -> None:
        self.process = process
        self.stdout_path = stdout_path
        self.stderr_path = stderr_path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def wait(self, timeout_s: float = 120.0) -> int:
        """The exit code; fails with the child's stderr if it is still running after ``timeout_s``."""
        try:
            return await asyncio.wait_for(self.process.wait(), timeout_s)
        except TimeoutError:
            pass
        self.process.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), 10)
        raise AssertionError(f"{self.stdout_path.stem} still running after {timeout_s} s: {self.stderr[-8000:]}")

    async def close(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        await self.process.wait()


class FulmenProcesses:
    """Starts `fulmen` children on one Redis and experiment; logs go to ``log_dir``."""

    def __init__(self, log_dir: Path, redis_url: str, experiment: str) -> None:
        self.log_dir = log_dir
        self.redis_url = redis_url
        self.experiment = experiment
        self.started: list[FulmenProcess] = []

    async def start(self, *args: str, env: dict[str, str] | None = None) -> FulmenProcess:
        """``fulmen *args``, run from the repository's root (so ``examples.…`` agents import)."""
        name = f"{len(self.started):02d}-{args[0]}"
        stdout_path, stderr_path = self.log_dir / f"{name}.stdout", self.log_dir / f"{name}.stderr"
        with stdout_path.open("wb") as stdout, stderr_path.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                FULMEN,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                cwd=REPO,
                env=env or child_env(self.redis_url, self.experiment),
            )
        self.started.append(FulmenProcess(process, stdout_path, stderr_path))
        return self.started[-1]

    async def runner(self, agent: str, *args: str, env: dict[str, str] | None = None) -> FulmenProcess:
        return await self.start("runner", "--agent", agent, *args, env=env)

    async def close(self) -> None:
        for process in self.started:
            await process.close()


@contextlib.asynccontextmanager
async def fulmen_processes(log_dir: Path, redis_url: str, experiment: str) -> AsyncIterator[FulmenProcesses]:
    """`FulmenProcesses`; every child still alive is killed on exit."""
    processes = FulmenProcesses(log_dir, redis_url, experiment)
    try:
        yield processes
    finally:
        await processes.close()


async def wait_until_ready(store: RedisStore, *runners: FulmenProcess, timeout_s: float = 120.0) -> None:
    """Return once every runner has registered as a worker (it registers as it starts to claim);
    fails with the stderr of a runner that exited instead."""
    wanted = {r.pid: r for r in runners}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        pids = {w.metadata.get("pid") for w in await store.registry.query_workers()}
        if wanted.keys() <= pids:
            return
        for pid, runner in wanted.items():
            if runner.process.returncode is not None:
                raise AssertionError(f"runner {pid} exited with {runner.process.returncode}: {runner.stderr}")
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"runners {sorted(wanted.keys() - pids)} did not register")
        await asyncio.sleep(0.05)


def worker_id_of(store_workers: list, pid: int) -> str:
    """The worker id of the runner process ``pid`` among `store.registry.query_workers()`."""
    (worker_id,) = [w.worker_id for w in store_workers if w.metadata.get("pid") == pid]
    return worker_id
