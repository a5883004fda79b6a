"""Worker processes for the store's concurrency and crash tests, and the test side that drives them.

A child runs this file as a script (``python tests/store/workers.py <command> <json-args>``), so it
imports only fulmen, redis and the standard library. Protocol: the child writes JSON lines on stdout
(``{"ready": ...}`` once connected, then its results) and waits for one line on stdin where the test
needs a common start (``go``) or an order (``finish``). Both sides live here so they cannot drift apart;
the tests load this file by its path, which works whatever pytest's import mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.redis.connection import async_client
from fulmen.watchdog import sweep

SCRIPT = Path(__file__).resolve()

# --- child side -----------------------------------------------------------------------------------


def _emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def _wait_line() -> str:
    """One line from the test (a thread, so heartbeats go on while waiting)."""
    return (await asyncio.to_thread(sys.stdin.readline)).strip()


async def _store(url: str, experiment: str, reclaim_idle_s: float = 10.0) -> RedisStore:
    store = RedisStore(async_client(url), experiment, reclaim_idle_s=reclaim_idle_s)
    await store.queue.ensure()
    await store.redis.ping()
    return store


async def claim(url: str, experiment: str, worker_id: str, batch: int, reclaim_idle_s: float) -> None:
    """After ``go``, claim batches until no rollout is queuing; report every (rollout, attempt)."""
    store = await _store(url, experiment, reclaim_idle_s)
    _emit(ready=worker_id)
    await _wait_line()
    claimed: list[list[str]] = []
    while True:
        got = await store.queue.dequeue_rollouts(worker_id, batch)
        claimed += [[c.rollout.rollout_id, c.attempt.attempt_id, c.attempt.worker_id or ""] for c in got]
        # An empty batch is not the end when reclaim stole our entries: the status index is.
        if not got and not await store.redis.scard(store.keys.status(RolloutStatus.QUEUING)):
            break
    _emit(claimed=claimed)
    await store.aclose()


async def watchdog(url: str, experiment: str) -> None:
    """After ``go``, run one watchdog sweep; report its outcome counters."""
    store = await _store(url, experiment)
    _emit(ready=os.getpid())
    await _wait_line()
    outcomes = await sweep(store)
    _emit(outcomes=dict(outcomes))
    await store.aclose()


async def hold(url: str, experiment: str, worker_id: str, count: int, heartbeat_s: float) -> None:
    """Claim ``count`` rollouts and heartbeat them until killed, or until ``finish`` arrives: then
    report every attempt succeeded (as a worker frozen past its heartbeat would on waking)."""
    store = await _store(url, experiment)
    held: list[tuple[str, str]] = []
    deadline = time.monotonic() + 30
    while len(held) < count and time.monotonic() < deadline:
        got = await store.queue.dequeue_rollouts(worker_id, count - len(held), block_s=1.0)
        held += [(c.rollout.rollout_id, c.attempt.attempt_id) for c in got]

    async def beat_all() -> None:
        await asyncio.gather(*(store.spans.heartbeat(rid, aid) for rid, aid in held))

    await beat_all()
    _emit(held=held)

    async def beat_forever() -> None:
        while True:
            await asyncio.sleep(heartbeat_s)
            await beat_all()

    beating = asyncio.create_task(beat_forever())
    order = await _wait_line()
    beating.cancel()
    if order == "finish":
        codes = [await store.rollouts.update_attempt(rid, aid, status="succeeded") for rid, aid in held]
        _emit(finished=[[rid, aid, code] for (rid, aid), code in zip(held, codes, strict=True)])
    await store.aclose()


async def run(url: str, experiment: str, worker_id: str, count: int, timeout_s: float) -> None:
    """Claim rollouts as they come until ``count`` have been run; report each succeeded."""
    store = await _store(url, experiment)
    _emit(ready=worker_id)
    ran: list[list[str]] = []
    deadline = time.monotonic() + timeout_s
    while len(ran) < count and time.monotonic() < deadline:
        for c in await store.queue.dequeue_rollouts(worker_id, count - len(ran), block_s=0.5):
            code = await store.rollouts.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status="succeeded")
            ran.append([c.rollout.rollout_id, c.attempt.attempt_id, code or ""])
    _emit(ran=ran)
    await store.aclose()


COMMANDS: dict[str, Callable[..., Awaitable[None]]] = {
    "claim": claim,
    "watchdog": watchdog,
    "hold": hold,
    "run": run,
}


def main() -> None:
    logging.basicConfig(level=logging.ERROR)  # the watchdog warns once per attempt: keep stderr short
    command, args = sys.argv[1], json.loads(sys.argv[2])
    asyncio.run(COMMANDS[command](**args))


# --- test side ------------------------------------------------------------------------------------


class WorkerProcess:
    """One child running a command of this file, seen from the test."""

    def __init__(self, process: asyncio.subprocess.Process, stderr_path: Path) -> None:
        self.process = process
        self.stderr_path = stderr_path

    @classmethod
    async def start(cls, command: str, log_dir: Path, **args: Any) -> WorkerProcess:
        stderr_path = log_dir / f"{command}-{len(list(log_dir.glob(command + '-*')))}.stderr"
        with stderr_path.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                str(SCRIPT),
                command,
                json.dumps(args),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                limit=1 << 24,  # one JSON line carries every claim of a worker
            )
        return cls(process, stderr_path)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def event(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The next JSON line; fails with the child's stderr if it exited instead."""
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout_s)
        if not line:
            code = await self.process.wait()
            raise AssertionError(f"worker exited with {code}: {self.stderr_path.read_text()[-4000:]}")
        return json.loads(line)

    async def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        await self.process.stdin.drain()

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def wait(self, timeout_s: float = 30.0) -> int:
        return await asyncio.wait_for(self.process.wait(), timeout_s)

    async def close(self) -> None:
        """Make sure the child is gone (SIGCONT first, in case a test froze it)."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        await self.process.wait()


Spawn = Callable[..., Awaitable[WorkerProcess]]


@contextlib.asynccontextmanager
async def spawner(log_dir: Path) -> AsyncIterator[Spawn]:
    """``spawn(command, **args)`` starts a worker process; every one still alive is killed on exit."""
    started: list[WorkerProcess] = []

    async def spawn(command: str, **args: Any) -> WorkerProcess:
        started.append(await WorkerProcess.start(command, log_dir, **args))
        return started[-1]

    try:
        yield spawn
    finally:
        for process in started:
            await process.close()


if __name__ == "__main__":
    main()
