"""One loop that heartbeats every running attempt of the process, and stops the abandoned ones.

The beats due at one tick go in one round trip; an abandoned attempt's task is cancelled with the
reason (`abandoned_reason`). More: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from fulmen.records import AttemptedRollout
from fulmen.records.status import ACTIVE_ATTEMPT, RolloutStatus
from fulmen.store import RedisStore

log = logging.getLogger(__name__)

HEARTBEAT_MAX_S = 10.0  # also how soon a runner notices that its rollout was cancelled


@dataclass
class _Watched:
    rollout_id: str
    task: asyncio.Task[object]
    interval_s: float
    due: float


class Heartbeats:
    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self._watched: dict[str, _Watched] = {}
        self._abandoned: dict[str, str] = {}

    def watch(self, claimed: AttemptedRollout, task: asyncio.Task[object]) -> None:
        unresponsive = claimed.rollout.config.unresponsive_seconds
        interval = min(HEARTBEAT_MAX_S, unresponsive / 3 if unresponsive else HEARTBEAT_MAX_S)
        self._watched[claimed.attempt.attempt_id] = _Watched(
            claimed.rollout.rollout_id, task, interval, time.monotonic() + interval
        )

    def unwatch(self, attempt_id: str) -> None:
        self._watched.pop(attempt_id, None)

    def abandoned_reason(self, attempt_id: str) -> str | None:
        return self._abandoned.pop(attempt_id, None)

    async def run(self) -> None:
        """Beat until cancelled; a failed beat is logged and tried again at the next tick."""
        while True:
            tick = min((w.interval_s for w in self._watched.values()), default=HEARTBEAT_MAX_S)
            await asyncio.sleep(min(tick, 1.0))
            now = time.monotonic()
            due = [(aid, w) for aid, w in self._watched.items() if w.due <= now]
            if not due:
                continue
            for _, w in due:
                w.due = now + w.interval_s
            replies = await asyncio.gather(
                *(self.store.spans.heartbeat(w.rollout_id, aid) for aid, w in due), return_exceptions=True
            )
            for (aid, w), reply in zip(due, replies, strict=True):
                if isinstance(reply, BaseException):
                    log.warning("heartbeat of %s failed: %s", aid, reply)
                    continue
                rollout_status, attempt_status = reply
                reason = None
                if rollout_status is RolloutStatus.CANCELLED:
                    reason = f"rollout {w.rollout_id} was cancelled"
                elif attempt_status not in ACTIVE_ATTEMPT:
                    reason = f"attempt {aid} is {attempt_status.value} in the store"
                if reason is not None and aid in self._watched:
                    self._abandoned[aid] = reason
                    self.unwatch(aid)
                    w.task.cancel()
