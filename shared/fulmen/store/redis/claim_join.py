"""Joining claims: the claims one process's coroutines make for one worker id in the same loop
iteration become one claim of their summed count, whose rollouts are shared out among them.

Why: docs/design/store.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
Claim = Callable[[str, int, "float | None"], Awaitable[list[T]]]


class ClaimJoin(Generic[T]):
    """Runs ``claim(worker_id, count, block_s)`` once per (worker id, block_s) and loop iteration for
    every caller of `claim` in that iteration. Callers are served in the order they called, each up to
    its count, in the order the claim returned the rollouts (higher lanes first). Rollouts claimed for
    a caller that was cancelled meanwhile are not dropped: the worker's next claim returns them first
    (they are begun attempts, and would otherwise wait for the watchdog)."""

    def __init__(self, claim: Claim[T]) -> None:
        self._claim = claim
        self._joining: dict[tuple[str, float | None], list[tuple[int, asyncio.Future[list[T]]]]] = {}
        self._spare: dict[str, list[T]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # strong references while running
        self._loop: asyncio.AbstractEventLoop | None = None

    async def claim(self, worker_id: str, count: int, block_s: float | None) -> list[T]:
        spare = self._spare.get(worker_id)
        if spare:
            taken, self._spare[worker_id] = spare[:count], spare[count:]
            return taken
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # used from a new loop: a join left on the old one never started
            self._loop, self._joining = loop, {}
        key = (worker_id, block_s)
        waiters = self._joining.get(key)
        if waiters is None:
            waiters = self._joining[key] = []
            loop.call_soon(self._start, key)
        future: asyncio.Future[list[T]] = loop.create_future()
        waiters.append((count, future))
        return await future

    def _start(self, key: tuple[str, float | None]) -> None:
        waiters = self._joining.pop(key)
        task = asyncio.ensure_future(self._run(key, waiters))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: tuple[str, float | None], waiters: list[tuple[int, asyncio.Future[list[T]]]]) -> None:
        worker_id, block_s = key
        loop = asyncio.get_running_loop()
        deadline = None if block_s is None else loop.time() + block_s
        live = [(n, f) for n, f in waiters if not f.done()]
        while live:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                claimed = await self._claim(worker_id, sum(n for n, _ in live), remaining)
            except BaseException as e:
                for _, future in live:
                    if not future.done():
                        future.set_exception(e) if isinstance(e, Exception) else future.cancel()
                if not isinstance(e, Exception):
                    raise
                return
            unserved = []
            for n, future in live:
                if future.done():  # cancelled while the claim ran
                    continue
                if claimed:
                    future.set_result(claimed[:n])
                    claimed = claimed[n:]
                else:
                    unserved.append((n, future))
            if claimed:  # more than the callers still waiting asked for
                self._spare.setdefault(worker_id, []).extend(claimed)
            # The queue ran short of the joined count: the callers left with nothing wait for work as
            # long as they asked to, as they would have alone (an empty claim has waited it out).
            if unserved and (deadline is None or loop.time() >= deadline):
                for _, future in unserved:
                    future.set_result([])
                return
            live = unserved
