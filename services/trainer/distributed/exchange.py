"""The Redis rank exchange: the leader's step plans, each rank's gradient chunks, the leader's sum,
and the steps it agreed.

Four capped streams (``trainer_plans``, ``trainer_grads``, ``trainer_aggregates``, ``trainer_agreed``),
each read from where this rank joined. Plans and sums carry the leader's lease epoch; a rank ignores
a plan of an older lease than one it has seen (a deposed leader's). What the ranks do with what they
read: `fulmen_trainer.distributed.rank_group`; the lease: `fulmen_trainer.distributed.leadership`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgpack

from fulmen.errors import RecordError
from fulmen.records import GradientChunk, RankPlan
from fulmen.records.ranks import AgreedStep
from fulmen.store import RedisStore
from fulmen.store.redis.stream import MAX_BLOCK_S, Cursor, Fields
from fulmen_trainer.distributed.membership import Membership

log = logging.getLogger(__name__)

STREAM_MAXLEN = 2000  # plans, gradients and aggregates of old steps are not needed again
READ_COUNT = 100  # entries per XREAD: a step's chunks and plans, with room for a rank that fell behind
# Reads block at most MAX_BLOCK_S (a dead connection is noticed); between two reads the leader checks
# whether a rank it waits for is gone, and a follower whether a newer plan made its wait moot.
PLAN_BLOCK_S = GATHER_BLOCK_S = AGGREGATE_BLOCK_S = MAX_BLOCK_S
POLL_S = 0.001  # a read that only takes what is already there

T = TypeVar("T")
Pass = tuple[int, int, int]  # (lease epoch, step, PPO epoch) of a sum


class Exchange:
    """The three streams of the rank exchange, read from where this rank joined."""

    def __init__(self, store: RedisStore, membership: Membership) -> None:
        self.store = store
        self.keys = store.keys
        self.members = membership
        self._cursors: dict[str, Cursor[Fields]] = {}
        self.reports: dict[tuple[int, int, int], dict[str, float]] = {}
        # Entries read but not yet asked for: one XREAD may return a later plan or aggregate than the
        # one awaited (a rank that fell behind), and dropping it would leave that rank waiting forever.
        self._plans: list[tuple[int, RankPlan]] = []
        self._aggregates: dict[Pass, list[bytes]] = {}
        self._agreed: dict[tuple[int, int], AgreedStep] = {}
        self.lease = 0  # the newest lease epoch seen on a plan: older leases' plans are ignored

    async def _xadd(self, stream: str, fields: dict[str, Any]) -> None:
        await self.store.redis.xadd(stream, fields, maxlen=STREAM_MAXLEN, approximate=True)

    async def _read(self, stream: str, block_s: float) -> list[tuple[str, Fields]]:
        return await self._cursors[stream].read(block_s, READ_COUNT)

    async def start_reading(self) -> None:
        """Read what is sent from now on: call it before anything this rank waits for can be sent.
        Entries stay raw here: a rank decodes only the plans and chunks meant for it."""
        for key in (self.keys.trainer_plans, self.keys.trainer_grads, self.keys.trainer_aggregates,
                    self.keys.trainer_agreed):
            self._cursors[key] = await self.store.ctx.stream(key, _raw).cursor()

    # leader → ranks
    async def send_plan(self, plan: RankPlan, lease: int) -> None:
        await self._xadd(self.keys.trainer_plans, {"rank": plan.rank, "lease": lease, "m": plan.to_wire()})

    async def next_plan(self, rank: int) -> tuple[int, RankPlan]:
        """The next plan for ``rank`` and the lease epoch of the leader that sent it."""
        while True:
            while not self._plans:
                self._take_plans(await self._read(self.keys.trainer_plans, PLAN_BLOCK_S), rank)
            lease, plan = self._plans.pop(0)
            if lease >= self.lease:
                return lease, plan

    def _take_plans(self, entries: list[tuple[str, Fields]], rank: int) -> None:
        """Keep the plans for ``rank``; the others' shares are not decoded at all. An entry that is
        not a plan (garbage on the stream) is skipped with a log line: waiting on is all a rank can do.
        A plan of an older lease than one seen is a deposed leader's: skipped too."""
        for entry_id, fields in entries:
            try:
                if _int_field(fields, b"rank") != rank:
                    continue
                lease = _lease_of(fields)
                plan = RankPlan.from_wire(fields.get(b"m"))
            except RecordError as e:
                log.warning("skipping %s entry %s: %s", self.keys.trainer_plans, entry_id, e)
                continue
            if lease < self.lease:
                log.warning("skipping the plan of step %d from lease %d: lease %d leads now", plan.step, lease,
                            self.lease)
                continue
            self.lease = lease
            self._plans.append((lease, plan))

    def newer_lease_queued(self, lease: int) -> bool:
        """Whether a plan of a newer lease than ``lease`` has been read (another leader took over)."""
        return any(queued > lease for queued, _ in self._plans)

    # ranks → leader
    async def send_gradient(self, step: int, rank: int, chunks: Sequence[bytes], report: dict[str, float],
                            epoch: int = 0, lease: int = 0) -> None:
        """The chunks of one pass (``epoch``) of ``step`` as lease ``lease``'s plan asked; the first entry
        also carries the rank's report (cosine to its true gradient, encode time), which the leader logs."""
        for i, chunk in enumerate(chunks):
            extra = {"report": msgpack.packb(report)} if i == 0 else {}
            await self._xadd(self.keys.trainer_grads,
                             {"step": step, "epoch": epoch, "rank": rank, "lease": lease, "m": chunk, **extra})

    async def gather(self, step: int, ranks: Sequence[int], deadline_s: float,
                     epoch: int = 0, lease: int = 0) -> dict[int, list[bytes]]:
        """The chunks of every rank in ``ranks`` for pass ``epoch`` of ``step`` of our lease ``lease`` (a
        rank's answer to an older leader's plan of the same step is another share). A rank that left the membership, or that
        has sent nothing for ``deadline_s``, is left out of this step: waiting on it could last forever
        (a rank that restarts has missed the plan). Whether the *next* step waits for the world to be
        whole again is the leader's choice (``on_rank_loss``)."""
        wanted = set(ranks)
        got: dict[int, list[bytes]] = {}
        complete: set[int] = set()
        deadline = time.monotonic() + deadline_s
        while wanted - complete:
            entries = await self._read(self.keys.trainer_grads, GATHER_BLOCK_S)
            for entry_id, f in entries:
                try:
                    if _pass_of(f) != (step, epoch) or _lease_of(f) != lease:
                        continue  # a late pass of a rank that was left out, or an answer to an older leader
                    rank, chunk = _int_field(f, b"rank"), _chunk(f, step)
                    report = _report(f)
                except RecordError as e:
                    log.warning("skipping %s entry %s: %s", self.keys.trainer_grads, entry_id, e)
                    continue
                if rank in complete or chunk.rank != rank:
                    log.warning("skipping %s entry %s: a chunk of rank %d sent as rank %d's, or one too many",
                                self.keys.trainer_grads, entry_id, chunk.rank, rank)
                    continue
                got.setdefault(rank, []).append(f[b"m"])
                if report is not None:
                    self.reports[(step, epoch, rank)] = report
                if len(got[rank]) >= chunk.count:
                    complete.add(rank)
            if entries:
                deadline = time.monotonic() + deadline_s  # progress: give the others time too
                continue
            gone = (wanted - complete) - set(await self.members.live())
            silent = wanted - complete if time.monotonic() > deadline else set()
            if gone or silent:
                log.warning("step %d: no gradient from rank(s) %s (%s); stepping without them", step,
                            sorted(gone or silent), "gone" if gone else "silent")
                wanted -= gone or silent
        return {r: got[r] for r in complete}

    # leader → ranks
    async def send_aggregate(self, step: int, chunks: Sequence[bytes], epoch: int = 0, lease: int = 0) -> None:
        for chunk in chunks:
            await self._xadd(self.keys.trainer_aggregates, {"step": step, "epoch": epoch, "lease": lease, "m": chunk})

    async def next_aggregate(self, step: int, epoch: int = 0, rank: int | None = None, lease: int = 0,
                             give_up: asyncio.Event | None = None) -> list[bytes] | None:
        """The sum of lease ``lease``'s leader for pass ``epoch`` of ``step``; None if a newer plan for
        ``rank`` arrives first (the leader went on without this rank, or another leads) or ``give_up``
        is set: that sum may never come."""
        key = (lease, step, epoch)

        def complete() -> list[bytes] | None:
            chunks = self._aggregates.get(key, [])
            if not chunks or len(chunks) < _chunk_count(chunks[-1]):
                return None
            # older ones can no longer be asked for: this rank applies aggregates in order
            self._aggregates = {k: v for k, v in self._aggregates.items() if k > key}
            return chunks

        async def read(block_s: float) -> bool:
            entries = await self._read(self.keys.trainer_aggregates, block_s)
            self._take_aggregates(entries, key)
            return bool(entries)

        return await self._wait(complete, read, rank, give_up)

    async def next_agreed(self, step: int, lease: int, rank: int | None = None,
                          give_up: asyncio.Event | None = None) -> AgreedStep | None:
        """The record that lease ``lease``'s leader agreed ``step``; None if a newer plan for ``rank``
        arrives first or ``give_up`` is set, and the record has not come by then (one more read
        settles it: the leader agrees a step before it sends the next plan)."""
        key = (lease, step)

        def found() -> AgreedStep | None:
            record = self._agreed.get(key)
            if record is not None:
                self._agreed = {k: v for k, v in self._agreed.items() if k > key}
            return record

        async def read(block_s: float) -> bool:
            entries = await self._read(self.keys.trainer_agreed, block_s)
            for entry_id, f in entries:
                try:
                    record = AgreedStep.from_wire(f.get(b"m"))
                except RecordError as e:
                    log.warning("skipping %s entry %s: %s", self.keys.trainer_agreed, entry_id, e)
                    continue
                if (record.epoch, record.step) >= key:
                    self._agreed[(record.epoch, record.step)] = record
            return bool(entries)

        return await self._wait(found, read, rank, give_up)

    async def _wait(self, found: Callable[[], T | None], read: Callable[[float], Awaitable[bool]],
                    rank: int | None, give_up: asyncio.Event | None) -> T | None:
        """``found()`` once it gives something, reading on (``read(block_s)``: whether it got
        entries) until then. The leader writes a step's sums and its record before the next plan, so
        once a plan for ``rank`` is visible (or ``give_up`` is set: this rank took over, and no older
        lease can write again), one more non-blocking read settles whether it was written."""
        last_look = False
        while True:
            got = found()
            if got is not None or last_look:
                return got
            if await read(AGGREGATE_BLOCK_S):
                continue
            if (give_up is not None and give_up.is_set()) or (rank is not None and await self._poll_plans(rank)):
                await read(POLL_S)
                last_look = True

    def _take_aggregates(self, entries: list[tuple[str, Fields]], key: Pass) -> None:
        """Keep the sums' chunks of pass ``key`` and later ones; garbage is skipped with a log line."""
        for entry_id, f in entries:
            try:
                step, epoch = _pass_of(f)
                got = (_lease_of(f), step, epoch)
                if got >= key:
                    _chunk(f, step)
                    self._aggregates.setdefault(got, []).append(f[b"m"])
            except RecordError as e:
                log.warning("skipping %s entry %s: %s", self.keys.trainer_aggregates, entry_id, e)

    async def _poll_plans(self, rank: int) -> bool:
        self._take_plans(await self._read(self.keys.trainer_plans, POLL_S), rank)
        return bool(self._plans)


def _chunk_count(chunk: bytes) -> int:
    try:
        return int(GradientChunk.from_wire(chunk).count)
    except RecordError:
        return 1  # a broken chunk: decoding it will say what is wrong


# Reading the plain fields of the rank streams' entries: anything unreadable is a RecordError, so the
# reader skips the entry (the streams are written by the ranks alone; garbage there is foreign).


def _int_field(fields: Fields, name: bytes) -> int:
    try:
        return int(fields[name])
    except (KeyError, ValueError, TypeError) as e:
        raise RecordError(f"field {name.decode()} is missing or not an integer ({e!r})") from None


def _pass_of(fields: Fields) -> tuple[int, int]:
    """(step, epoch) of a gradient or aggregate entry."""
    return _int_field(fields, b"step"), (_int_field(fields, b"epoch") if b"epoch" in fields else 0)


def _lease_of(fields: Fields) -> int:
    """The lease epoch of the leader a plan, gradient or sum entry belongs to."""
    return _int_field(fields, b"lease") if b"lease" in fields else 0


def _chunk(fields: Fields, step: int) -> GradientChunk:
    """The entry's chunk, decoded to check it (the codec decodes the payload later)."""
    chunk = GradientChunk.from_wire(fields.get(b"m"))
    if chunk.step != step:
        raise RecordError(f"a chunk of step {chunk.step} in an entry of step {step}")
    return chunk


def _report(fields: Fields) -> dict[str, float] | None:
    if b"report" not in fields:
        return None
    try:
        report = msgpack.unpackb(fields[b"report"])
    except (ValueError, msgpack.UnpackException) as e:
        raise RecordError(f"unreadable report: {e}") from None
    if not isinstance(report, dict):
        raise RecordError("a report must be a map")
    return report


def _raw(entry_id: str, fields: Fields) -> Fields:
    return fields
