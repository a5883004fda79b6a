"""Pause / drain / resume for the LLM proxies: the control stream's record (`fulmen_llm_proxy.control`
follows it; whoever updates weights synchronously writes it).

Wire form: an entry ``{"m": <msgpack record>}`` on ``store.keys.control``; the record is
``{"v": 1, "kind": "control", "action": "pause" | "drain" | "resume", "control_id": str,
"proxy_ids": [str] (empty: every proxy), "timeout_s": float | None, "time": float}``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from fulmen.records.base import Record, require, require_finite

DEFAULT_CONTROL_TIMEOUT_S = 120.0
MAX_CONTROL_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer is no timeout; say None for that


class ControlAction(StrEnum):
    PAUSE = "pause"  # hold new calls
    DRAIN = "drain"  # hold new calls and report ``drained`` once the running ones finish
    RESUME = "resume"


@dataclass(frozen=True, slots=True)
class ControlMessage(Record):
    """One broadcast to the proxies (every proxy reads every message)."""

    KIND: ClassVar[str] = "control"

    action: ControlAction
    control_id: str = ""
    proxy_ids: tuple[str, ...] = ()  # empty: every proxy
    # a pause or drain ends by itself after this long, so a writer that dies mid-update cannot
    # freeze the fleet
    timeout_s: float | None = DEFAULT_CONTROL_TIMEOUT_S
    time: float = 0.0

    def check_wire(self) -> None:
        require(self, all(type(p) is str for p in self.proxy_ids), "proxy_ids must be strings")
        # the proxy schedules its auto-resume on the event loop: a NaN, infinite or huge timeout
        # would raise there, or never resume
        require_finite(self, "time", minimum=0.0)
        require_finite(self, "timeout_s", minimum=0.0)
        require(self, self.timeout_s is None or self.timeout_s <= MAX_CONTROL_TIMEOUT_S,
                f"timeout_s {self.timeout_s!r} is over {MAX_CONTROL_TIMEOUT_S}")
