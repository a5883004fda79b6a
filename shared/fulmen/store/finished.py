"""The finished stream: every rollout that reached a terminal status, once. The adapter and the
algorithm consume it as consumer groups; `wait_for_rollouts` follows it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from fulmen.errors import NotFound
from fulmen.records import Rollout, RolloutFinished
from fulmen.records.status import TERMINAL_ROLLOUT
from fulmen.store.context import StoreContext
from fulmen.store.redis.stream import MAX_BLOCK_S, Fields, Stream
from fulmen.store.rollouts import Rollouts

log = logging.getLogger(__name__)

# With several shards, the longest a read blocks on one shard before it looks at the next.
SHARD_BLOCK_S = 0.05

DEFAULT_READ_COUNT = 100  # finished entries per group read unless the caller asks for another number
WAIT_READ_COUNT = 1000  # entries per read while waiting: many rollouts may finish at once


def decode_finished(entry_id: str, fields: Fields) -> RolloutFinished:
    return RolloutFinished.from_wire(fields.get(b"m"), entry_id=entry_id)


SHARD_MARK = "@"  # an entry id of shard i > 0 reads "<id>@<i>" (shard 0's are plain, as always)


def _decoder(shard: int) -> Callable[[str, Fields], RolloutFinished]:
    if shard == 0:
        return decode_finished
    return lambda entry_id, fields: decode_finished(f"{entry_id}{SHARD_MARK}{shard}", fields)


def split_entry_id(entry_id: str) -> tuple[int, str]:
    """(shard, the id in that shard's finished stream) of an id `read_finished` gave out."""
    raw, mark, shard = entry_id.partition(SHARD_MARK)
    return (int(shard), raw) if mark and shard.isdigit() else (0, entry_id)


class Finished:
    """Part of the store: reading, acknowledging and waiting on the finished streams (one per shard).

    A consumer group reads every shard's stream; the ids it hands out name their shard, so
    acknowledging and dead-lettering go to the right stream. With several shards a blocking read
    waits on one shard at a time for at most `SHARD_BLOCK_S`, moving on round-robin."""

    def __init__(self, ctx: StoreContext, rollouts: Rollouts) -> None:
        self.ctx = ctx
        self.rollouts = rollouts
        self.streams: list[Stream[RolloutFinished]] = [
            ctx.stream(shard.finished, _decoder(shard.index)) for shard in ctx.keys.shards
        ]
        self.stream = self.streams[0]
        self._groups: dict[str, list[Stream[RolloutFinished]]] = {}
        self._next_shard = 0

    def groups(self, group: str) -> list[Stream[RolloutFinished]]:
        """The finished streams as consumer group ``group``, one per shard (kept)."""
        streams = self._groups.get(group)
        if streams is None:
            streams = self._groups[group] = [
                self.ctx.stream(shard.finished, _decoder(shard.index), group=group) for shard in self.ctx.keys.shards
            ]
        return streams

    def group(self, group: str) -> Stream[RolloutFinished]:
        """Shard 0's finished stream as consumer group ``group``."""
        return self.groups(group)[0]

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout_s: float | None = None) -> list[Rollout]:
        """Block (on the finished streams, no polling) until every rollout is terminal or the
        timeout passes. Returns the rollouts that are terminal, in the order asked."""
        # taken before the statuses are read: nothing slips between
        cursors = [await stream.cursor() for stream in self.streams]
        current = await self.rollouts.get_rollouts(rollout_ids)
        missing = [rid for rid, r in zip(rollout_ids, current, strict=True) if r is None]
        if missing:
            raise NotFound(f"rollouts {missing[:5]} do not exist in experiment {self.ctx.experiment}")
        waiting = {r.rollout_id for r in current if r is not None and r.status not in TERMINAL_ROLLOUT}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        slice_s = MAX_BLOCK_S if len(cursors) == 1 else SHARD_BLOCK_S
        turn = 0
        while waiting:
            block_s = slice_s
            if deadline is not None:
                block_s = min(block_s, deadline - time.monotonic())
                if block_s <= 0:
                    break
            cursor = cursors[turn % len(cursors)]
            turn += 1
            for _, finished in await cursor.read(block_s, WAIT_READ_COUNT):
                waiting.discard(finished.rollout_id)
        done = await self.rollouts.get_rollouts(rollout_ids)
        return [r for r in done if r is not None and r.status in TERMINAL_ROLLOUT]

    async def ensure_finished_group(self, group: str, start: str = "0") -> None:
        for stream in self.groups(group):
            await stream.ensure_group(start)

    async def read_finished(
        self, group: str, consumer: str, count: int = DEFAULT_READ_COUNT, block_s: float | None = None, *,
        pending: bool = False,
    ) -> list[RolloutFinished]:
        """Finished rollouts for a consumer group (the adapter, the algorithm). Acknowledge each with
        `ack_finished` once its effect is stored; malformed entries are dead-lettered.
        ``pending``: instead, the entries this consumer read before and has not acknowledged (after a
        restart under the same consumer name), oldest first; acknowledge them to move on."""
        streams = self.groups(group)
        if len(streams) == 1:
            return [f for _, f in await streams[0].read(consumer, count, block_s, pending=pending)]
        start = self._next_shard
        self._next_shard = (start + 1) % len(streams)
        out: list[RolloutFinished] = []
        for step in range(len(streams)):
            stream = streams[(start + step) % len(streams)]
            out += [f for _, f in await stream.read(consumer, count - len(out), None, pending=pending)]
            if len(out) >= count:
                return out
        if out or pending or block_s is None:
            return out
        deadline = time.monotonic() + block_s
        turn = start
        while (remaining := deadline - time.monotonic()) > 0:
            stream = streams[turn % len(streams)]
            turn += 1
            got = [f for _, f in await stream.read(consumer, count, min(remaining, SHARD_BLOCK_S))]
            if got:
                return got
        return []

    async def ack_finished(self, group: str, entry_ids: Sequence[str]) -> int:
        streams = self.groups(group)
        if len(streams) == 1:
            return await streams[0].ack(entry_ids)
        by_shard: dict[int, list[str]] = {}
        for entry_id in entry_ids:
            shard, raw = split_entry_id(entry_id)
            by_shard.setdefault(shard, []).append(raw)
        return sum([await streams[shard].ack(ids) for shard, ids in by_shard.items()])

    async def dead_letter_finished(self, group: str, entry_id: str, reason: str) -> None:
        """Set aside a finished entry that decoded but cannot be acted on (its rollout is not terminal,
        or adapting it failed), with the reason and its raw fields, and acknowledge it for ``group``."""
        shard, raw = split_entry_id(entry_id)
        entries = await self.ctx.redis.xrange(self.ctx.keys.shards[shard].finished, raw, raw)
        await self.groups(group)[shard].dead_letter(raw, reason, entries[0][1] if entries else {})

    async def dead_letter_unknown(self, group: str, entries: Sequence[RolloutFinished]) -> None:
        """Set aside finished entries whose rollout the store does not know (never enqueued here, or
        deleted since): each with the reason and a warning line, acknowledged for ``group`` so it
        never blocks the group, and kept for a person to look at rather than dropped unseen."""
        for entry in entries:
            log.warning(
                "finished entry %s names rollout %s, unknown to experiment %s: dead-lettered for group %s",
                entry.entry_id, entry.rollout_id, self.ctx.experiment, group,
            )
            await self.dead_letter_finished(group, entry.entry_id, f"finished entry for unknown rollout {entry.rollout_id}")

    async def reclaim_finished(
        self, group: str, consumer: str, min_idle_ms: int, count: int = DEFAULT_READ_COUNT
    ) -> list[RolloutFinished]:
        """Entries of ``group`` that another consumer read and left unacknowledged for ``min_idle_ms``
        (it died), now ``consumer``'s (`Stream.reclaim`), from every shard."""
        out: list[RolloutFinished] = []
        for stream in self.groups(group):
            if len(out) >= count:
                break
            out += [f for _, f in await stream.reclaim(consumer, min_idle_ms, count - len(out))]
        return out
