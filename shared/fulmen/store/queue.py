"""Claiming rollouts from the queue: the runners' consumer group, each claim one round trip.

The claim script (`claim_script.CLAIM_NEXT`) reads and begins attempts atomically; priority lanes are
served in a cycle of 8 (`claim_script.CLAIM_ORDER`). The lane rule and its guarantees: docs/design/store.md.
"""

from __future__ import annotations

import time
from typing import Any

from redis.exceptions import ResponseError

from fulmen import keys as k
from fulmen.errors import InvalidInput, RecordError
from fulmen.records import AttemptedRollout, QueueEntry
from fulmen.store.context import StoreContext
from fulmen.store.lua import scripts
from fulmen.store.lua.claim import CLAIM_NEXT
from fulmen.store.redis.claim_join import ClaimJoin
from fulmen.store.redis.stream import Fields, block_ms, entry_id_text
from fulmen.store.rollouts import attempted, pairs

# A queue entry is pending only between delivery and claim (milliseconds), so one idle this long
# belongs to a consumer that died in between.
DEFAULT_RECLAIM_IDLE_S = 10.0
# With several shards, the longest a claim blocks on one shard's queue before it looks at the others:
# what an entry on another shard may wait when all queues were empty.
SHARD_BLOCK_S = 0.05

QueueItem = tuple[str, Fields]  # the rollout id, and the raw fields for a dead letter
LaneEntry = tuple[int, str, QueueItem]  # the lane (index in `keys.LANES`), the entry id, the item
NORMAL = k.LANES.index(k.DEFAULT_LANE)


def _decode(entry_id: str, fields: Fields) -> QueueItem:
    return QueueEntry.from_wire(fields.get(b"m")).rollout_id, fields


class Queue:
    """Part of the store: the runners' side of the rollout queue, one stream per lane and shard.

    With several shards a claim tries each shard's queues in turn, from a start shard that moves on
    by one each call (so no shard starves: each is first once every S calls); only when every queue
    is empty does it block, on one shard's lanes at a time for at most `SHARD_BLOCK_S`, in the same
    rotation. One shard (the default) claims as before lanes: one round trip, then one blocking read
    (of all its lanes at once)."""

    def __init__(self, ctx: StoreContext, reclaim_idle_s: float = DEFAULT_RECLAIM_IDLE_S) -> None:
        self.ctx = ctx
        # lanes[shard][lane]: every queue stream, in `keys.LANES` order
        self.lanes = [
            [ctx.stream(key, _decode, group=k.RUNNERS_GROUP) for key in shard.queues] for shard in ctx.keys.shards
        ]
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self._next_reclaim = [0.0] * len(self.lanes)
        self._next_shard = 0
        # Entries a blocking read delivered beyond the count asked for (several lanes answered at
        # once), per shard: pending on this process's consumers, claimed first by the next call.
        self._held: list[list[LaneEntry]] = [[] for _ in self.lanes]
        self._claim = ctx.script(CLAIM_NEXT)
        self._begin = ctx.script(scripts.BEGIN_ATTEMPTS)
        self._shards_checked = False
        self._join: ClaimJoin[AttemptedRollout] = ClaimJoin(self._dequeue)

    async def ensure(self) -> None:
        """Create the runners' groups and register the experiment (once per store; idempotent)."""
        if not self._shards_checked:
            await self._check_shards()
        if not all(stream.group_ready for lanes in self.lanes for stream in lanes):
            await self.ctx.register_experiment()
            for lanes in self.lanes:
                for stream in lanes:
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
        """Claim up to ``count`` queued rollouts for ``worker_id``, each with a new attempt, higher
        lanes first under the claim rule (module docstring).

        Blocks up to ``block_s`` seconds for work (None: return at once). Each rollout is claimed by
        exactly one worker; poison entries go to the dead-letter stream on the way. Calls for one
        worker id made in the same loop iteration are joined into one claim (`claim_join`).
        """
        await self.ensure()
        return await self._join.claim(worker_id, count, block_s)

    async def _dequeue(self, worker_id: str, count: int, block_s: float | None) -> list[AttemptedRollout]:
        deadline = None if block_s is None else time.monotonic() + block_s
        if len(self.lanes) > 1:
            return await self._dequeue_sharded(worker_id, count, deadline)
        while True:
            entries = self._take_held(0, count) or await self._reclaim(0, worker_id, count)
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
                entries = await self._read_lanes(0, worker_id, count, remaining_s)
            claimed = await self._claim_entries(0, worker_id, entries)
            if claimed or not entries or (deadline is not None and time.monotonic() >= deadline):
                return claimed

    async def _dequeue_sharded(self, worker_id: str, count: int, deadline: float | None) -> list[AttemptedRollout]:
        shards = len(self.lanes)
        start = self._next_shard
        self._next_shard = (start + 1) % shards
        while True:
            progressed = False
            claimed: list[AttemptedRollout] = []
            for step in range(shards):  # fill up to count from the shards in turn
                i = (start + step) % shards
                want = count - len(claimed)
                entries = self._take_held(i, want) or await self._reclaim(i, worker_id, want)
                claimed += await self._claim_entries(i, worker_id, entries)
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
            entries = await self._read_lanes(start, worker_id, count, min(remaining_s, SHARD_BLOCK_S))
            claimed = await self._claim_entries(start, worker_id, entries)
            if claimed:
                return claimed
            start = (start + 1) % shards

    async def dequeue_rollout(self, worker_id: str, block_s: float | None = None) -> AttemptedRollout | None:
        claimed = await self.dequeue_rollouts(worker_id, 1, block_s)
        return claimed[0] if claimed else None

    def _take_held(self, shard: int, count: int) -> list[LaneEntry]:
        held = self._held[shard]
        if not held:
            return []
        taken, self._held[shard] = held[:count], held[count:]
        return taken

    async def _recover(self, shard: int, error: ResponseError) -> None:
        """A read of the shard's queues failed: if a group is gone (the experiment was deleted under
        us), create every lane's group again and go on; else raise ``error``."""
        if "NOGROUP" not in str(error):
            raise error
        for stream in self.lanes[shard]:
            await stream.recover(error)
        self.ctx.forget_registration()
        await self.ctx.register_experiment()

    async def _read_lanes(
        self, shard: int, worker_id: str, count: int, block_s: float | None
    ) -> list[LaneEntry]:
        """New entries of the shard's lanes, blocking up to ``block_s`` for one (one XREADGROUP over
        all lanes: they share the shard's slot). At most ``count`` come back, highest lane first; the
        rest (several lanes answered at once) are held for the next call."""
        lanes = self.lanes[shard]
        streams = {stream.key: ">" for stream in lanes}
        block = block_ms(block_s)
        try:
            reply = await self.ctx.redis.xreadgroup(k.RUNNERS_GROUP, worker_id, streams, count=count, block=block)
        except ResponseError as e:
            await self._recover(shard, e)
            reply = await self.ctx.redis.xreadgroup(k.RUNNERS_GROUP, worker_id, streams, count=count, block=block)
        by_key = {entry_id_text(key): entries for key, entries in reply or []}
        out: list[LaneEntry] = []
        for lane, stream in enumerate(lanes):
            for entry_id, item in await stream.decode_entries(by_key.get(stream.key, [])):
                out.append((lane, entry_id, item))
        self._held[shard] += out[count:]
        return out[:count]

    async def _claim_next(
        self, shard: int, worker_id: str, count: int
    ) -> tuple[list[AttemptedRollout], int] | None:
        """Read and claim up to ``count`` new entries of a shard's queues in one round trip
        (CLAIM_NEXT); entries it could not claim go through `_claim_entries`, which dead-letters
        them. Returns the claimed rollouts and how many entries were read, or None if a group had to
        be created again."""
        try:
            reply = await self.ctx.pipeline.submit(self._claim, [self.ctx.keys.shards[shard].prefix, worker_id, count])
        except ResponseError as e:
            await self._recover(shard, e)
            return None
        claimed = [attempted(r) for r in reply[0]]
        if reply[1]:
            leftover: list[LaneEntry] = []
            for lua_lane, raw_id, flat in reply[1]:
                lane, entry_id, fields = int(lua_lane) - 1, raw_id.decode(), pairs(flat)
                try:
                    leftover.append((lane, entry_id, _decode(entry_id, fields)))
                except RecordError as e:
                    await self._dead_letter(shard, lane, entry_id, str(e), fields)
            claimed += await self._claim_entries(shard, worker_id, leftover)
        return claimed, int(reply[2])

    async def _reclaim(self, shard: int, worker_id: str, count: int) -> list[LaneEntry]:
        """Entries a dead runner left pending, at most every half idle period (XAUTOCLAIM is a round
        trip per lane, and nothing can have gone idle sooner)."""
        now = time.monotonic()
        if now < self._next_reclaim[shard]:
            return []
        self._next_reclaim[shard] = now + self.reclaim_idle_ms / 2000
        out: list[LaneEntry] = []
        for lane, stream in enumerate(self.lanes[shard]):
            if len(out) >= count:
                break
            for entry_id, item in await stream.reclaim(worker_id, self.reclaim_idle_ms, count - len(out)):
                out.append((lane, entry_id, item))
        return out

    async def _claim_entries(self, shard: int, worker_id: str, entries: list[LaneEntry]) -> list[AttemptedRollout]:
        """Begin an attempt for each decoded entry (BEGIN_ATTEMPTS once per lane, in one round trip);
        an entry whose rollout does not exist is dead-lettered."""
        if not entries:
            return []
        prefix = self.ctx.keys.shards[shard].prefix
        by_lane: dict[int, list[LaneEntry]] = {}
        for entry in entries:
            by_lane.setdefault(entry[0], []).append(entry)
        arg_lists: list[list[Any]] = []
        for lane, lane_entries in sorted(by_lane.items()):
            args: list[Any] = [prefix, worker_id, lane + 1]  # Lua numbers lanes from 1
            for _, entry_id, (rollout_id, _fields) in lane_entries:
                args += [entry_id, rollout_id]
            arg_lists.append(args)
        replies = await self.ctx.each(self._begin, arg_lists)
        claimed = []
        for (lane, lane_entries), results in zip(sorted(by_lane.items()), replies, strict=True):
            for (_, entry_id, (rollout_id, fields)), result in zip(lane_entries, results, strict=True):
                code = result[0].decode()
                if code == "ok":
                    claimed.append(attempted(result))
                elif code == "missing":
                    await self._dead_letter(shard, lane, entry_id, f"rollout {rollout_id} does not exist", fields)
        return claimed

    async def _dead_letter(self, shard: int, lane: int, entry_id: str, reason: str, fields: Fields) -> None:
        """Dead-letter an entry; off the normal lane it is deleted too, as a claimed one is, so the
        lane's length stays what waits there (CLAIM_NEXT reads the normal lane alone when it is 0)."""
        stream = self.lanes[shard][lane]
        await stream.dead_letter(entry_id, reason, fields)
        if lane != NORMAL:
            await self.ctx.redis.xdel(stream.key, entry_id)
