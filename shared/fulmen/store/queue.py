"""Claiming rollouts from the queue: the runners' consumer group, each claim one round trip.

The claim script (`scripts.CLAIM_NEXT`) reads new entries with XREADGROUP inside Lua and begins an
attempt for each, acknowledging the entry in the same step, so an entry is pending only between
delivery and claim when the queue is read outside the script (the blocking read of an empty queue).
Entries delivered to a consumer that died in that window are taken over with XAUTOCLAIM
(`Stream.reclaim`). A claimed attempt that stops heartbeating is the watchdog's
(`fulmen.store.watchdog`), which requeues or fails it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from redis.exceptions import ResponseError

from fulmen import keys as k
from fulmen.errors import RecordError
from fulmen.records import AttemptedRollout, QueueEntry
from fulmen.store import scripts
from fulmen.store.context import StoreContext
from fulmen.store.rollouts import attempted, pairs
from fulmen.store.stream import Fields

# A queue entry is pending only between delivery and claim (milliseconds), so one idle this long
# belongs to a consumer that died in between.
DEFAULT_RECLAIM_IDLE_S = 10.0

QueueItem = tuple[str, Fields]  # the rollout id, and the raw fields for a dead letter


def _decode(entry_id: str, fields: Fields) -> QueueItem:
    return QueueEntry.from_wire(fields.get(b"m")).rollout_id, fields


class Queue:
    """Part of the store: the runners' side of the rollout queue."""

    def __init__(self, ctx: StoreContext, reclaim_idle_s: float = DEFAULT_RECLAIM_IDLE_S) -> None:
        self.ctx = ctx
        self.stream = ctx.stream(ctx.keys.queue, _decode, group=k.RUNNERS_GROUP)
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self._next_reclaim = 0.0
        self._claim = ctx.script(scripts.CLAIM_NEXT)
        self._begin = ctx.script(scripts.BEGIN_ATTEMPTS)

    async def ensure(self) -> None:
        """Create the runners' group and register the experiment (once per store; idempotent)."""
        if not self.stream.group_ready:
            await self.ctx.register_experiment()
            await self.stream.ensure_group()

    async def dequeue_rollouts(
        self, worker_id: str, count: int = 1, block_s: float | None = None
    ) -> list[AttemptedRollout]:
        """Claim up to ``count`` queued rollouts for ``worker_id``, each with a new attempt.

        Blocks up to ``block_s`` seconds for work (None: return at once). Each rollout is claimed by
        exactly one worker; poison entries go to the dead-letter stream on the way.
        """
        await self.ensure()
        deadline = None if block_s is None else time.monotonic() + block_s
        while True:
            entries = await self._reclaim(worker_id, count)
            if not entries:
                # Read and claim in one round trip; only an empty queue goes on to the blocking read.
                read = await self._claim_next(worker_id, count)
                if read is not None:
                    claimed, n_read = read
                    if claimed:
                        return claimed
                    if n_read:
                        continue  # all it read was stale or poison: work may wait behind it
                    if deadline is None or time.monotonic() >= deadline:
                        return []
                remaining_s = None if deadline is None else max(0.0, deadline - time.monotonic())
                entries = await self.stream.read(worker_id, count, remaining_s)
            claimed = await self._claim_entries(worker_id, entries)
            if claimed or not entries or (deadline is not None and time.monotonic() >= deadline):
                return claimed

    async def dequeue_rollout(self, worker_id: str, block_s: float | None = None) -> AttemptedRollout | None:
        claimed = await self.dequeue_rollouts(worker_id, 1, block_s)
        return claimed[0] if claimed else None

    async def _claim_next(self, worker_id: str, count: int) -> tuple[list[AttemptedRollout], int] | None:
        """Read and claim up to ``count`` new queue entries in one round trip (CLAIM_NEXT); entries
        it could not claim go through `_claim_entries`, which dead-letters them. Returns the claimed
        rollouts and how many entries were read, or None if the group had to be created again."""
        try:
            reply = await self.ctx.pipeline.submit(self._claim, [self.ctx.keys.prefix, worker_id, count])
        except ResponseError as e:
            await self.stream.recover(e)  # the experiment was deleted under us: go on with a new group
            self.ctx.forget_registration()
            await self.ctx.register_experiment()
            return None
        claimed = [attempted(r) for r in reply[0]]
        if reply[1]:
            leftover = []
            for raw_id, flat in reply[1]:
                entry_id = raw_id.decode()
                fields = pairs(flat)
                try:
                    leftover.append((entry_id, _decode(entry_id, fields)))
                except RecordError as e:
                    await self.stream.dead_letter(entry_id, str(e), fields)
            claimed += await self._claim_entries(worker_id, leftover)
        return claimed, int(reply[2])

    async def _reclaim(self, worker_id: str, count: int) -> list[tuple[str, QueueItem]]:
        """Entries a dead runner left pending, at most every half idle period (XAUTOCLAIM is a round
        trip, and nothing can have gone idle sooner)."""
        now = time.monotonic()
        if now < self._next_reclaim:
            return []
        self._next_reclaim = now + self.reclaim_idle_ms / 2000
        return await self.stream.reclaim(worker_id, self.reclaim_idle_ms, count)

    async def _claim_entries(self, worker_id: str, entries: list[tuple[str, QueueItem]]) -> list[AttemptedRollout]:
        """Begin an attempt for each decoded entry (BEGIN_ATTEMPTS, one round trip); an entry whose
        rollout does not exist is dead-lettered."""
        if not entries:
            return []
        args: list[Any] = [self.ctx.keys.prefix, worker_id]
        fields_by_id: dict[str, Mapping[bytes, bytes]] = {}
        for entry_id, (rollout_id, fields) in entries:
            fields_by_id[entry_id] = fields
            args += [entry_id, rollout_id]
        results = await self._begin(keys=args[:1], args=args[1:])
        claimed = []
        for i, result in enumerate(results):
            entry_id, rollout_id = args[2 + 2 * i], args[3 + 2 * i]
            code = result[0].decode()
            if code == "ok":
                claimed.append(attempted(result))
            elif code == "missing":
                await self.stream.dead_letter(entry_id, f"rollout {rollout_id} does not exist", fields_by_id[entry_id])
        return claimed
