"""The threads sync agents run in: a bounded pool of the runner's own, with its hung threads counted.

Why not asyncio's default executor: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

THREAD_NAME_PREFIX = "fulmen-agent"


def pool_size(concurrency: int) -> int:
    """Threads for a runner of ``concurrency`` slots: one per slot, plus as many again so that the
    threads of timed-out agents still running do not take the slots of new attempts at once."""
    return 2 * concurrency


class AgentThreads:
    def __init__(self, size: int) -> None:
        self.size = size
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix=THREAD_NAME_PREFIX)
        self._lock = threading.Lock()  # the counters change in agent threads and on the loop
        self.running = 0  # threads running an agent now
        self.hung = 0  # of those, the ones whose attempt is over: they run on, holding their thread
        self.abandoned = 0  # calls ever left running after their attempt ended (a counter)
        self._warned_full = False

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a pool thread, in a copy of the caller's context (so the agent's
        spans stay bound to its attempt). Cancelled (the attempt ended), the call is dropped if it
        has not started, else its thread is counted as hung until the function returns."""
        call = functools.partial(contextvars.copy_context().run, self._counted, fn, *args, **kwargs)
        future: Future[Any] = self._pool.submit(call)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.cancel():  # started: it runs on in its thread, nothing can stop it
                self._mark_hung(future)
            raise

    def _counted(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.running += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self.running -= 1

    def _mark_hung(self, future: Future[Any]) -> None:
        with self._lock:
            self.hung += 1
            self.abandoned += 1
            hung = self.hung
        future.add_done_callback(self._unmark_hung)  # runs at once if it has just finished
        if hung >= self.size // 2 and not self._warned_full:
            self._warned_full = True
            log.warning(
                "%d of %d agent threads run agents whose attempt is over (they ignore their timeout); "
                "new sync attempts wait for a free thread", hung, self.size,
            )

    def _unmark_hung(self, _: Future[Any]) -> None:
        with self._lock:
            self.hung -= 1

    def shutdown(self) -> None:
        """Start no more calls; threads still running an agent are left to finish on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
