"""The finished stream: every rollout that reached a terminal status, once. The adapter and the
algorithm consume it as consumer groups; `wait_for_rollouts` follows it."""

from __future__ import annotations

import time
from collections.abc import Sequence

from fulmen.errors import NotFound
from fulmen.records import Rollout, RolloutFinished
from fulmen.records.status import TERMINAL_ROLLOUT
from fulmen.store.context import StoreContext
from fulmen.store.rollouts import Rollouts
from fulmen.store.stream import MAX_BLOCK_S, Fields, Stream

DEFAULT_READ_COUNT = 100  # finished entries per group read unless the caller asks for another number
WAIT_READ_COUNT = 1000  # entries per read while waiting: many rollouts may finish at once


def decode_finished(entry_id: str, fields: Fields) -> RolloutFinished:
    return RolloutFinished.from_wire(fields.get(b"m"), entry_id=entry_id)


class Finished:
    """Part of the store: reading, acknowledging and waiting on the finished stream."""

    def __init__(self, ctx: StoreContext, rollouts: Rollouts) -> None:
        self.ctx = ctx
        self.rollouts = rollouts
        self.stream: Stream[RolloutFinished] = ctx.stream(ctx.keys.finished, decode_finished)
        self._groups: dict[str, Stream[RolloutFinished]] = {}

    def group(self, group: str) -> Stream[RolloutFinished]:
        """The finished stream as consumer group ``group`` (one `Stream` per group, kept)."""
        stream = self._groups.get(group)
        if stream is None:
            stream = self._groups[group] = self.ctx.stream(self.ctx.keys.finished, decode_finished, group=group)
        return stream

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout_s: float | None = None) -> list[Rollout]:
        """Block (on the finished stream, no polling) until every rollout is terminal or the
        timeout passes. Returns the rollouts that are terminal, in the order asked."""
        cursor = await self.stream.cursor()  # taken before the statuses are read: nothing slips between
        current = await self.rollouts.get_rollouts(rollout_ids)
        missing = [rid for rid, r in zip(rollout_ids, current, strict=True) if r is None]
        if missing:
            raise NotFound(f"rollouts {missing[:5]} do not exist in experiment {self.ctx.experiment}")
        waiting = {r.rollout_id for r in current if r is not None and r.status not in TERMINAL_ROLLOUT}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            block_s = MAX_BLOCK_S
            if deadline is not None:
                block_s = min(block_s, deadline - time.monotonic())
                if block_s <= 0:
                    break
            for _, finished in await cursor.read(block_s, WAIT_READ_COUNT):
                waiting.discard(finished.rollout_id)
        done = await self.rollouts.get_rollouts(rollout_ids)
        return [r for r in done if r is not None and r.status in TERMINAL_ROLLOUT]

    async def ensure_finished_group(self, group: str, start: str = "0") -> None:
        await self.group(group).ensure_group(start)

    async def read_finished(
        self, group: str, consumer: str, count: int = DEFAULT_READ_COUNT, block_s: float | None = None, *,
        pending: bool = False,
    ) -> list[RolloutFinished]:
        """Finished rollouts for a consumer group (the adapter, the algorithm). Acknowledge each with
        `ack_finished` once its effect is stored; malformed entries are dead-lettered.
        ``pending``: instead, the entries this consumer read before and has not acknowledged (after a
        restart under the same consumer name), oldest first; acknowledge them to move on."""
        return [f for _, f in await self.group(group).read(consumer, count, block_s, pending=pending)]

    async def ack_finished(self, group: str, entry_ids: Sequence[str]) -> int:
        return await self.group(group).ack(entry_ids)

    async def dead_letter_finished(self, group: str, entry_id: str, reason: str) -> None:
        """Set aside a finished entry that decoded but cannot be acted on (its rollout is not terminal,
        or adapting it failed), with the reason and its raw fields, and acknowledge it for ``group``."""
        entries = await self.ctx.redis.xrange(self.ctx.keys.finished, entry_id, entry_id)
        await self.group(group).dead_letter(entry_id, reason, entries[0][1] if entries else {})

    async def reclaim_finished(
        self, group: str, consumer: str, min_idle_ms: int, count: int = DEFAULT_READ_COUNT
    ) -> list[RolloutFinished]:
        """Entries of ``group`` that another consumer read and left unacknowledged for ``min_idle_ms``
        (it died), now ``consumer``'s (`Stream.reclaim`)."""
        return [f for _, f in await self.group(group).reclaim(consumer, min_idle_ms, count)]
