"""Spans and heartbeats: each span gets the next sequence id of its rollout; a span is a heartbeat."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import fields as dataclass_fields
from operator import attrgetter
from typing import Any

from fulmen.errors import NotFound
from fulmen.records import AttemptStatus, RolloutStatus, Span
from fulmen.records.spans import entry_records, pack_span_batch
from fulmen.store.context import StoreContext
from fulmen.store.lua import spans as span_scripts

# Every Span field but sequence_id, in order: building a Span positionally is much cheaper than
# dataclasses.replace, which add_spans would otherwise call for every stored span.
_span_fields = attrgetter(*(f.name for f in dataclass_fields(Span) if f.name != "sequence_id"))


def _with_sequence(span: Span, sequence_id: int) -> Span:
    return Span(*_span_fields(span), sequence_id=sequence_id)


def dedupe_key(span: Span) -> str:
    """What the store remembers of a stored span to refuse it again: its attempt and span id, hashed
    to a signed 64-bit integer in decimal. A rollout's set of them is then an intset (8 bytes a span,
    searched in place) rather than a hash table of strings (tens of bytes a span, an allocation each).
    Two different spans of one rollout share a key with odds of about n²/2⁶⁵ for n spans."""
    digest = hashlib.blake2b(f"{span.attempt_id}/{span.span_id}".encode(), digest_size=8).digest()
    return str(int.from_bytes(digest, "little", signed=True))


class SpanBatch:
    """The spans of one attempt that one store call sends (`span_scripts.store_spans`): repeats within the
    call dropped (the first kept), their dedupe keys, and their records as one value."""

    def __init__(self, spans: Sequence[Span], max_bytes: int, records: dict[str, bytes] | None = None) -> None:
        self.max_bytes = max_bytes
        unique: dict[str, Span] = {}
        for s in spans:
            unique.setdefault(dedupe_key(s), s)
        self.keys = list(unique)
        self.spans = list(unique.values())
        # Encoded once (a span over max_bytes raises here, before anything is written).
        self.records = records if records is not None else {key: s.to_wire(max_bytes) for key, s in unique.items()}

    def args(self) -> list[Any]:
        """What `store_spans` takes: the records as one value, then the dedupe keys."""
        if not self.spans:
            return []
        return [pack_span_batch([self.records[key] for key in self.keys]), *self.keys]

    def without(self, positions: Sequence[Any]) -> SpanBatch:
        """This batch less the spans at ``positions`` (1-based, as the script reports them)."""
        drop = {int(p) - 1 for p in positions}
        return SpanBatch([s for i, s in enumerate(self.spans) if i not in drop], self.max_bytes, self.records)

    def stored(self, last_seq: int) -> list[Span]:
        """The spans with the sequence ids the store gave them, the last one ``last_seq``."""
        first = last_seq - len(self.spans) + 1
        return [_with_sequence(s, first + i) for i, s in enumerate(self.spans)]


class Spans:
    """Part of the store: storing spans (deduplicated), heartbeats, reading a rollout's spans."""

    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx
        self._add_spans = ctx.joinable_script(span_scripts.ADD_SPANS, span_scripts.ADD_SPANS_JOINED)

    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        """Store spans (one round trip per call). Each new span gets the next sequence id of its
        rollout; a span already stored (same attempt and span id) is ignored. Counts as a heartbeat.
        Returns the spans stored now, with their sequence ids. Spans of an unknown attempt raise
        NotFound; the other attempts' spans in the same call are stored all the same (retrying the
        call is safe: duplicates are ignored)."""
        return [s for batch, last_seq in await self._store(spans) for s in batch.stored(last_seq)]

    async def record_spans(self, spans: Sequence[Span]) -> int:
        """`add_spans` for a writer that needs no copies of what was stored (the proxy, the runner):
        how many spans were stored now."""
        return sum(len(batch.spans) for batch, _ in await self._store(spans))

    async def _store(self, spans: Sequence[Span]) -> list[tuple[SpanBatch, int]]:
        """Each attempt's batch as stored, and the sequence id of its last span."""
        by_attempt: dict[tuple[str, str], list[Span]] = {}
        for s in spans:
            by_attempt.setdefault((s.rollout_id, s.attempt_id), []).append(s)
        if not by_attempt:
            return []
        if len(by_attempt) == 1:  # the usual call (a proxy's, a runner's): no task for a gather of one
            [((rollout_id, attempt_id), group)] = by_attempt.items()
            return [await self._add(rollout_id, attempt_id, group)]
        return list(await asyncio.gather(*(
            self._add(rollout_id, attempt_id, group) for (rollout_id, attempt_id), group in by_attempt.items()
        )))

    async def _add(self, rollout_id: str, attempt_id: str, spans: list[Span]) -> tuple[SpanBatch, int]:
        """One attempt's spans, sent again without those the store reports as already stored."""
        prefix = self.ctx.keys.shard(rollout_id).prefix
        batch = SpanBatch(spans, self.ctx.max_record_bytes)
        while True:
            result = await self.ctx.pipeline.submit(self._add_spans, [prefix, rollout_id, attempt_id, *batch.args()])
            if result[0] == b"missing":
                raise NotFound(f"attempt {attempt_id} of rollout {rollout_id} does not exist")
            if result[0] != b"dup":
                return batch, int(result[2])
            batch = batch.without(result[1:])  # with none left, the call is a heartbeat, as a duplicate is

    async def add_span(self, span: Span) -> Span | None:
        """Store one span; None if it was a duplicate."""
        stored = await self.add_spans([span])
        return stored[0] if stored else None

    async def heartbeat(self, rollout_id: str, attempt_id: str) -> tuple[RolloutStatus, AttemptStatus]:
        """Tell the store the attempt is alive. Returns the rollout's and the attempt's status, so a
        worker learns at once that its rollout was cancelled or its attempt given up on."""
        prefix = self.ctx.keys.shard(rollout_id).prefix
        result = await self.ctx.pipeline.submit(self._add_spans, [prefix, rollout_id, attempt_id])
        if result[0] == b"missing":
            raise NotFound(f"attempt {attempt_id} of rollout {rollout_id} does not exist")
        return RolloutStatus(result[0].decode()), AttemptStatus(result[1].decode())

    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
        *,
        name: str | None = None,
        after_sequence_id: int = 0,
        limit: int | None = None,
    ) -> list[Span]:
        """A rollout's spans in sequence order, optionally of one attempt (``"latest"``: the latest)
        or one span name; paginate with ``after_sequence_id`` (the last one seen) and ``limit``."""
        if attempt_id == "latest":
            raw = await self.ctx.redis.hget(self.ctx.keys.rollout(rollout_id), "attempt_id")
            if raw is None:
                raise NotFound(f"rollout {rollout_id} does not exist in experiment {self.ctx.experiment}")
            attempt_id = raw.decode() or None
        entries = await self.ctx.redis.xrange(
            self.ctx.keys.spans(rollout_id),
            min=f"({after_sequence_id}-0" if after_sequence_id else "-",
            count=None,
        )
        spans = []
        for entry_id, fields in entries:
            # An entry holds the spans of one call, numbered up to its id: the first entry past
            # after_sequence_id may begin with spans already seen.
            for sequence_id, record in entry_records(entry_id, fields):
                if sequence_id <= after_sequence_id:
                    continue
                span = Span.from_wire(record, sequence_id, self.ctx.max_record_bytes)
                if (attempt_id is None or span.attempt_id == attempt_id) and (name is None or span.name == name):
                    spans.append(span)
                    if limit is not None and len(spans) >= limit:
                        return spans
        return spans
