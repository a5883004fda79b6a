"""The runner's main loop: claim rollouts for the free slots, run each attempt, stop cleanly.

One claim call for all free slots; on SIGTERM, ``grace_s`` for in-flight attempts, then the rest go
back to the queue. More: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Sequence

from fulmen.sdk.agent import Agent
from fulmen.sdk.hooks import Hook
from fulmen.settings import RunnerSettings
from fulmen.store import RedisStore
from fulmen.telemetry.tracing import SpanBuffer
from fulmen_runner.agent_threads import AgentThreads, pool_size
from fulmen_runner.execute import AttemptContext, Outcome, execute
from fulmen_runner.heartbeats import Heartbeats
from fulmen_runner.inputs import InputResolver
from fulmen_runner.span_writer import SpanWriter

log = logging.getLogger(__name__)

CLAIM_BLOCK_S = 1.0  # a blocked claim re-checks for a stop request this often
WORKER_HEARTBEAT_S = 5.0


def default_worker_id() -> str:
    return f"runner-{socket.gethostname()}-{os.getpid()}"


class Runner:
    def __init__(
        self,
        store: RedisStore,
        agent: Agent,
        buffer: SpanBuffer,
        settings: RunnerSettings,
        *,
        hooks: Sequence[Hook] = (),
        worker_id: str | None = None,
    ) -> None:
        """``settings``: its concurrency, grace_s, llm_base_url, proxy_retry_s and proxy key
        (`RunnerSettings.proxy_key`)."""
        self.store = store
        self.concurrency = settings.concurrency
        self.grace_s = settings.grace_s
        self.worker_id = worker_id or default_worker_id()
        self.writer = SpanWriter(store, buffer)
        self.heartbeats = Heartbeats(store)
        self.threads = AgentThreads(pool_size(self.concurrency))  # sync agents', never the default executor
        self.ctx = AttemptContext(
            store,
            agent,
            hooks,
            InputResolver(store, llm_base_url=settings.llm_base_url, api_key=settings.proxy_key()),
            self.writer,
            self.heartbeats,
            self.worker_id,
            self.threads,
            settings.proxy_retry_s,
        )
        self.stopping = asyncio.Event()
        self.running: set[asyncio.Task[Outcome]] = set()
        self.claimed = 0  # rollouts claimed by this process (its claim rate on /metrics)
        self.finished = 0
        self.failed = 0
        self.started_at = time.monotonic()

    def stop(self) -> None:
        """Stop claiming; `run` then winds down within ``grace_s``."""
        if not self.stopping.is_set():
            log.info("runner %s stopping: %d attempt(s) in flight", self.worker_id, len(self.running))
            self.stopping.set()

    async def run(self, max_rollouts: int | None = None) -> None:
        """Claim and run until `stop` (or ``max_rollouts`` claimed, for tests and benchmarks)."""
        await self.store.queue.ensure()
        log.info("runner %s: %d slot(s) on experiment %s", self.worker_id, self.concurrency, self.store.experiment)
        background = [
            asyncio.create_task(self.writer.run(), name="span-writer"),
            asyncio.create_task(self.heartbeats.run(), name="attempt-heartbeats"),
            asyncio.create_task(self._report_worker(), name="worker-heartbeat"),
        ]
        claimed_total = 0
        try:
            while not self.stopping.is_set():
                if max_rollouts is not None and claimed_total >= max_rollouts:
                    break
                free = self.concurrency - len(self.running)
                if free <= 0:
                    await self._wait_for_a_slot()
                    continue
                if max_rollouts is not None:
                    free = min(free, max_rollouts - claimed_total)
                claimed = await self.store.queue.dequeue_rollouts(self.worker_id, free, block_s=CLAIM_BLOCK_S)
                claimed_total += len(claimed)
                self.claimed += len(claimed)
                for c in claimed:
                    task = asyncio.create_task(execute(self.ctx, c), name=f"attempt-{c.attempt.attempt_id}")
                    self.running.add(task)
                    task.add_done_callback(self._done)
            await self._wind_down()
        finally:
            self.threads.shutdown()  # takes no new calls; a thread still in an agent finishes on its own
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.writer.flush_all()
            await self.store.registry.update_worker(self.worker_id, "stopped", self._worker_metadata())

    def _done(self, task: asyncio.Task[Outcome]) -> None:
        self.running.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:  # execute() reports agent errors itself; this is a runner bug or Redis loss
            log.error("attempt task %s crashed: %r", task.get_name(), error, exc_info=error)
            self.failed += 1
            return
        self.finished += 1

    async def _wait_for_a_slot(self) -> None:
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({stop, *self.running}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()

    async def _wind_down(self) -> None:
        """Let in-flight attempts finish within the grace period, then hand the rest back."""
        if not self.running:
            return
        if self.stopping.is_set():
            _, late = await asyncio.wait(set(self.running), timeout=self.grace_s)
        else:  # max_rollouts reached: wait for the work in hand
            late = set()
            await asyncio.gather(*self.running, return_exceptions=True)
        for task in late:
            task.cancel()  # execute() hands the attempt back on cancellation
        if late:
            log.info("handing back %d attempt(s) still running after %.1f s", len(late), self.grace_s)
            await asyncio.gather(*late, return_exceptions=True)

    def _worker_metadata(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "concurrency": self.concurrency,
            "running": len(self.running),
            "finished": self.finished,
            "uptime_s": round(time.monotonic() - self.started_at, 1),
        }

    async def _report_worker(self) -> None:
        while True:
            try:
                status = "stopping" if self.stopping.is_set() else ("busy" if self.running else "idle")
                await self.store.registry.update_worker(self.worker_id, status, self._worker_metadata())
            except Exception as e:
                log.warning("worker heartbeat failed: %s", e)
            await asyncio.sleep(WORKER_HEARTBEAT_S)
