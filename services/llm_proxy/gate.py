"""Admission of new completions: serving, paused (new calls wait), or closing (new calls get 503);
and held (new calls wait, as paused) while the proxy waits for a model version it must serve first.

Calls in flight always finish; the serving fast path is a flag test and an increment, no await.
More: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fulmen_llm_proxy.errors import ProxyError

# How long a new call waits while paused before its 503: long enough for a weight update to finish,
# short enough that an agent's own timeout is not reached first.
PAUSED_WAIT_S = 60.0


class Gate:
    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self.state = "serving"  # serving | paused | draining | closing
        self.in_flight = 0
        self.wait_s = PAUSED_WAIT_S
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_change = on_change
        self.held: str | None = None  # why new calls wait whatever the state (a version to load first)
        self._unheld = asyncio.Event()
        self._unheld.set()

    async def enter(self) -> None:
        """Admit one call (wait while paused or held); pair with `leave`."""
        if self.held is not None:
            await self._wait_unheld()
        if self.state != "serving":
            if self.state == "closing":
                raise _shutting_down()
            try:
                await asyncio.wait_for(self._open.wait(), self.wait_s)
            except TimeoutError:
                raise ProxyError(
                    503, f"the proxy is {self.state} for a weight update; retry later", code=self.state
                ) from None
            if self.state == "closing":
                raise _shutting_down()
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def set_state(self, state: str) -> None:
        if state == self.state or self.state == "closing":
            return
        self.state = state
        if state == "serving":
            self._open.set()
        elif state == "closing":
            self._open.set()  # wake the waiters: they get their 503
        else:
            self._open.clear()
        if self._on_change is not None:
            self._on_change()

    def hold(self, reason: str) -> None:
        """New calls wait (up to ``wait_s``, then a 503 with ``reason``) until `release`, whatever the
        state: the proxy does not answer with weights it must not serve."""
        self.held = reason
        self._unheld.clear()

    def release(self) -> None:
        self.held = None
        self._unheld.set()

    async def _wait_unheld(self) -> None:
        reason = self.held
        try:
            await asyncio.wait_for(self._unheld.wait(), self.wait_s)
        except TimeoutError:
            raise ProxyError(503, f"the proxy is {self.held or reason}; retry later", code="waiting_for_version") from None

    async def wait_idle(self, timeout_s: float | None = None) -> bool:
        """True once no call is in flight (within ``timeout_s``)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


def _shutting_down() -> ProxyError:
    return ProxyError(503, "the proxy is shutting down; retry on another", code="shutting_down")
