"""Pause / drain / resume on the control stream, for synchronous weight updates.

The record is `fulmen.records.ControlMessage`; a pause or drain ends by itself after ``timeout_s``.
The protocol: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from fulmen.errors import RecordError
from fulmen.records.control import DEFAULT_CONTROL_TIMEOUT_S, ControlAction, ControlMessage
from fulmen.store import RedisStore
from fulmen_llm_proxy.gate import Gate

log = logging.getLogger(__name__)

ACTIONS = tuple(ControlAction)
DEFAULT_TIMEOUT_S = DEFAULT_CONTROL_TIMEOUT_S
# Control messages kept on the stream: a proxy only ever needs the latest at start, then follows.
CONTROL_STREAM_MAXLEN = 1000
CONTROL_ID_HEX = 12  # hex digits of a control id: unique among the messages kept
CONTROL_READ_COUNT = 100  # messages per read: a follower that fell behind catches up in one


async def send_control(
    store: RedisStore,
    action: str,
    *,
    proxy_ids: tuple[str, ...] = (),
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> ControlMessage:
    """Broadcast one control message; returns it (its ``control_id`` comes back in the registry)."""
    if action not in ACTIONS:
        raise ValueError(f"control action {action!r} unknown; use {', '.join(ACTIONS)}")
    control_id = uuid.uuid4().hex[:CONTROL_ID_HEX]
    message = ControlMessage(ControlAction(action), control_id, tuple(proxy_ids), timeout_s, time.time())
    await store.redis.xadd(
        store.keys.control, {"m": message.to_wire()}, maxlen=CONTROL_STREAM_MAXLEN, approximate=True
    )
    return message


class ControlFollower:
    """Applies control messages to a `Gate`; ``on_change`` runs after each state change (the proxy
    re-registers at once, so the trainer sees ``drained`` without waiting for a heartbeat)."""

    def __init__(self, store: RedisStore, gate: Gate, proxy_id: str, on_change: Callable[[], Any]) -> None:
        self.store = store
        self.gate = gate
        self.proxy_id = proxy_id
        self.on_change = on_change
        self.control_id = ""
        self.drained = False
        self._auto_resume: asyncio.TimerHandle | None = None
        self._drain_task: asyncio.Task[None] | None = None

    @property
    def state(self) -> str:
        return "drained" if self.drained and self.gate.state == "draining" else self.gate.state

    async def run(self) -> None:
        """Apply the latest message if it still holds (a pause or drain within its timeout), then
        every message sent from then on."""
        stream = self.store.ctx.stream(self.store.keys.control, _decode)
        after = "0-0"
        last = await stream.last()
        if last is not None:
            after = last[0]
            message = _decode_or_none(last[1])
            if message and message.action != "resume":
                age_s = time.time() - message.time
                if message.timeout_s is None or age_s < message.timeout_s:
                    self.apply(message, elapsed_s=age_s)
        async for _, message in stream.follow(after, count=CONTROL_READ_COUNT):
            self.apply(message)

    def apply(self, message: ControlMessage, elapsed_s: float = 0.0) -> None:
        if message.proxy_ids and self.proxy_id not in message.proxy_ids:
            return
        log.info("control %s (%s)", message.action, message.control_id)
        if self._auto_resume is not None:
            self._auto_resume.cancel()
            self._auto_resume = None
        if self._drain_task is not None:
            self._drain_task.cancel()
            self._drain_task = None
        self.control_id = message.control_id
        self.drained = False
        state = {"pause": "paused", "drain": "draining", "resume": "serving"}[message.action]
        self.gate.set_state(state)
        if state != "serving" and message.timeout_s is not None:
            delay_s = max(0.0, message.timeout_s - elapsed_s)
            self._auto_resume = asyncio.get_running_loop().call_later(delay_s, self._timed_out)
        if state == "draining":
            self._drain_task = asyncio.ensure_future(self._report_drained())
        self.on_change()

    def _timed_out(self) -> None:
        log.warning("control %s timed out: resuming", self.control_id)
        self._auto_resume = None
        self.drained = False
        self.gate.set_state("serving")
        self.on_change()

    async def _report_drained(self) -> None:
        await self.gate.wait_idle()
        self.drained = True
        self.on_change()

    def close(self) -> None:
        if self._auto_resume is not None:
            self._auto_resume.cancel()
        if self._drain_task is not None:
            self._drain_task.cancel()


def _decode(entry_id: str, fields: Mapping[bytes, bytes]) -> ControlMessage:
    return ControlMessage.from_wire(fields.get(b"m"))


def _decode_or_none(fields: Mapping[bytes, bytes]) -> ControlMessage | None:
    try:
        return ControlMessage.from_wire(fields.get(b"m"))
    except RecordError as e:
        log.warning("ignoring a control message: %s", e)
        return None
