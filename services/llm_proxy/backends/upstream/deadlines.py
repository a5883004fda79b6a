"""Timeouts for many concurrent upstream calls on one timer.

`asyncio.timeout` arms and cancels a loop timer for every call and runs a few dozen lines of Python
around it; `Deadlines` keeps each call's deadline in a dict and one timer at the earliest of them,
so a call whose deadline is later than the armed one (every call when they all get the same
timeout) costs a dict insert and a dict pop.
"""

from __future__ import annotations

import asyncio
import math


class Deadlines:
    """Cancel a task whose deadline passed, as `asyncio.timeout` would (`expired` tells the two apart)."""

    def __init__(self) -> None:
        self._reset(None)

    def _reset(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop
        self._deadlines: dict[asyncio.Task[object], tuple[float, int]] = {}  # task -> (deadline, cancelling then)
        self._expired: set[asyncio.Task[object]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def start(self, delay_s: float) -> asyncio.Task[object]:
        """Give the running task ``delay_s`` seconds from now; `stop` it when its await is over."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (tests): nothing of the old one carries over
            self._reset(loop)
        task = asyncio.current_task()
        assert task is not None, "Deadlines.start outside a task"
        when = loop.time() + delay_s
        self._deadlines[task] = (when, task.cancelling())
        if when < self._timer_at:
            self._arm(when)
        return task

    def expired(self, task: asyncio.Task[object]) -> bool:
        """Whether the CancelledError ``task`` got came from its deadline (and only from it: a
        cancellation from elsewhere as well is left to propagate)."""
        if task not in self._expired:
            return False
        self._expired.discard(task)
        _, cancelling = self._deadlines.pop(task, (0.0, 0))
        return task.uncancel() <= cancelling

    def stop(self, task: asyncio.Task[object]) -> None:
        """The task's await is over: forget its deadline (the timer stays armed; firing early is a no-op)."""
        self._deadlines.pop(task, None)
        if task in self._expired:  # cancelled by its deadline as its await ended: take that back
            self._expired.discard(task)
            task.uncancel()

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer = self._loop.call_at(when, self._fire)
        self._timer_at = when

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        assert self._loop is not None
        now = self._loop.time()
        earliest = math.inf
        for task, (when, _) in self._deadlines.items():
            if when <= now:
                if task not in self._expired:
                    self._expired.add(task)
                    task.cancel()
            elif when < earliest:
                earliest = when
        if earliest < math.inf:
            self._arm(earliest)
