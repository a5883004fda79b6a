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
from fulmen.errors import InvalidInput, RecordError
from fulmen.records import AttemptedRollout, QueueEntry
from fulmen.store import scripts
from fulmen.store.context import StoreContext
from fulmen.store.rollouts import attempted, pairs
from fulmen.store.stream import Fields

# A queue entry is pending only between delivery and claim (milliseconds), so one idle this long
# belongs to a consumer that died in between.
DEFAULT_RECLAIM_IDLE_S = 10.0
# With several shards, the longest a claim blocks on one shard's queue before it looks at the others:
# what an entry on another shard may wait when all queues were empty.
SHARD_BLOCK_S = 0.05

QueueItem = tuple[str, Fields]  # the rollout id, and the raw fields for a dead letter


def _decode(entry_id: str, fields: Fields) -> QueueItem:
    return QueueEntry.from_wire(fields.get(b"m")).rollout_id, fields


class Queue:
    """Part of the store: the runners' side of the rollout queue, one stream per shard.

    With several shards a claim tries each shard's queue in turn, from a start shard that moves on by
    one each call (so no shard starves: each is first once every S calls); only when every queue is
    empty does it block, on one shard at a time for at most `SHARD_BLOCK_S`, in the same rotation.
    One shard (the default) claims exactly as before: one round trip, then one blocking read."""

    def __init__(self, ctx: StoreContext, reclaim_idle_s: float = DEFAULT_RECLAIM_IDLE_S) -> None:
        self.ctx = ctx
        self.streams = [ctx.stream(shard.queue, _decode, group=k.RUNNERS_GROUP) for shard in ctx.keys.shards]
        self.stream = self.streams[0]
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self._next_reclaim = [0.0] * len(self.streams)
        self._next_shard = 0
        self._claim = ctx.script(scripts.CLAIM_NEXT)
        self._begin = ctx.script(scripts.BEGIN_ATTEMPTS)
        self._shards_checked = False

    async def ensure(self) -> None:
        """Create the runners' groups and register the experiment (once per store; idempotent)."""
        if not self._shards_checked:
            await self._check_shards()
        if not all(stream.group_ready for stream in self.streams):
            await self.ctx.register_experiment()
            for stream in self.streams:
                if not stream.group_ready:
                    await stream.ensure_group()

    async def _check_shards(self) -> None:
        """The experiment's shard count is written once; a process configured with another one would
        put rollouts where the others never look, so it stops with a clear error instead."""
        keys = self.ctx.keys
        pipe = self.ctx.redis.pipeline(transaction=False)
        pipe.setnx(keys.shards_count, len(keys.shards))
        pipe.get(keys.shards_count)
        _, stored = await pipe.execute()
        if stored is not None and int(stored) != len(keys.shards):
            raise InvalidInput(
                f"experiment {self.ctx.experiment} has {int(stored)} store shards, this process "
                f"{len(keys.shards)}: set {k.SHARDS_ENV}={int(stored)} (or use another experiment)"
            )
        self._shards_checked = True

    async def dequeue_rollouts(
        self, worker_id: str, count: int = 1, block_s: float | None = None
    ) -> list[AttemptedRollout]:
        """Claim up to ``count`` queued rollouts for ``worker_id``, each with a new attempt.

        Blocks up to ``block_s`` seconds for work (None: return at once). Each rollout is claimed by
        exactly one worker; poison entries go to the dead-letter stream on the way.
        """
        await self.ensure()
        deadline = None if block_s is None else time.monotonic() + block_s
        if len(self.streams) > 1:
            return await self._dequeue_sharded(worker_id, count, deadline)
        while True:
            entries = await self._reclaim(0, worker_id, count)
            if not entries:
                # Read and claim in one round trip; only an empty queue goes on to the blocking read.
                read = await self._claim_next(0, worker_id, count)
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
            claimed = await self._claim_entries(0, worker_id, entries)
            if claimed or not entries or (deadline is not None and time.monotonic() >= deadline):
                return claimed

    async def _dequeue_sharded(self, worker_id: str, count: int, deadline: float | None) -> list[AttemptedRollout]:
        shards = len(self.streams)
        start = self._next_shard
        self._next_shard = (start + 1) % shards
        while True:
            progressed = False
            claimed: list[AttemptedRollout] = []
            for step in range(shards):  # fill up to count from the shards in turn
                i = (start + step) % shards
                claimed += await self._claim_entries(i, worker_id, await self._reclaim(i, worker_id, count - len(claimed)))
                if len(claimed) >= count:
                    return claimed
                read = await self._claim_next(i, worker_id, count - len(claimed))
                if read is None:
                    continue
                claimed += read[0]
                if len(claimed) >= count:
                    return claimed
                progressed = progressed or read[1] > 0
            if claimed:
                return claimed
            if progressed:
                continue  # stale or poison entries were skipped: look again before waiting
            if deadline is None or time.monotonic() >= deadline:
                return []
            remaining_s = max(0.0, deadline - time.monotonic())
            entries = await self.streams[start].read(worker_id, count, min(remaining_s, SHARD_BLOCK_S))
            claimed = await self._claim_entries(start, worker_id, entries)
            if claimed:
                return claimed
            start = (start + 1) % shards

    async def dequeue_rollout(self, worker_id: str, block_s: float | None = None) -> AttemptedRollout | None:
        claimed = await self.dequeue_rollouts(worker_id, 1, block_s)
        return claimed[0] if claimed else None

    async def _claim_next(
        self, shard: int, worker_id: str, count: int
    ) -> tuple[list[AttemptedRollout], int] | None:
        """Read and claim up to ``count`` new entries of a shard's queue in one round trip
        (CLAIM_NEXT); entries it could not claim go through `_claim_entries`, which dead-letters
        them. Returns the claimed rollouts and how many entries were read, or None if the group had
        to be created again."""
        stream = self.streams[shard]
        try:
            reply = await self.ctx.pipeline.submit(self._claim, [self.ctx.keys.shards[shard].prefix, worker_id, count])
        except ResponseError as e:
            await stream.recover(e)  # the experiment was deleted under us: go on with a new group
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
                    await stream.dead_letter(entry_id, str(e), fields)
            claimed += await self._claim_entries(shard, worker_id, leftover)
        return claimed, int(reply[2])

    async def _reclaim(self, shard: int, worker_id: str, count: int) -> list[tuple[str, QueueItem]]:
        """Entries a dead runner left pending, at most every half idle period (XAUTOCLAIM is a round
        trip, and nothing can have gone idle sooner)."""
        now = time.monotonic()
        if now < self._next_reclaim[shard]:
            return []
        self._next_reclaim[shard] = now + self.reclaim_idle_ms / 2000
        return await self.streams[shard].reclaim(worker_id, self.reclaim_idle_ms, count)

    async def _claim_entries(
        self, shard: int, worker_id: str, entries: list[tuple[str, QueueItem]]
    ) -> list[AttemptedRollout]:
        """Begin an attempt for each decoded entry (BEGIN_ATTEMPTS, one round trip); an entry whose
        rollout does not exist is dead-lettered."""
        if not entries:
            return []
        args: list[Any] = [worker_id]
        fields_by_id: dict[str, Mapping[bytes, bytes]] = {}
        for entry_id, (rollout_id, fields) in entries:
            fields_by_id[entry_id] = fields
            args += [entry_id, rollout_id]
        results = await self._begin(keys=[self.ctx.keys.shards[shard].prefix], args=args)
        claimed = []
        for i, result in enumerate(results):
            entry_id, rollout_id = args[1 + 2 * i], args[2 + 2 * i]
            code = result[0].decode()
            if code == "ok":
                claimed.append(attempted(result))
            elif code == "missing":
                await self.streams[shard].dead_letter(
                    entry_id, f"rollout {rollout_id} does not exist", fields_by_id[entry_id]
                )
        return claimed
