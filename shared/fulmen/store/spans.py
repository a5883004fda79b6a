"""Spans and heartbeats: each span gets the next sequence id of its rollout; a span is a heartbeat."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields as dataclass_fields
from typing import Any

from fulmen.errors import NotFound
from fulmen.records import AttemptStatus, RolloutStatus, Span
from fulmen.records.spans import entry_records
from fulmen.store import scripts
from fulmen.store.context import StoreContext

# Every Span field but sequence_id, in order: building a Span positionally is much cheaper than
# dataclasses.replace, which add_spans would otherwise call for every stored span.
_SPAN_FIELDS = tuple(f.name for f in dataclass_fields(Span) if f.name != "sequence_id")


def _with_sequence(span: Span, sequence_id: int) -> Span:
    return Span(*[getattr(span, name) for name in _SPAN_FIELDS], sequence_id=sequence_id)


class Spans:
    """Part of the store: storing spans (deduplicated), heartbeats, reading a rollout's spans."""

    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx
        self._add_spans = ctx.script(scripts.ADD_SPANS)

    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        """Store spans (one round trip per call). Each new span gets the next sequence id of its
        rollout; a span already stored (same attempt and span id) is ignored. Counts as a heartbeat.
        Returns the spans stored now, with their sequence ids. Spans of an unknown attempt raise
        NotFound; the other attempts' spans in the same call are stored all the same (retrying the
        call is safe: duplicates are ignored)."""
        by_attempt: dict[tuple[str, str], list[Span]] = {}
        for s in spans:
            by_attempt.setdefault((s.rollout_id, s.attempt_id), []).append(s)
        if not by_attempt:
            return []
        keys, max_bytes = self.ctx.keys, self.ctx.max_record_bytes
        arg_lists = []
        for (rollout_id, attempt_id), group in by_attempt.items():
            args: list[Any] = [keys.shard(rollout_id).prefix, rollout_id, attempt_id]
            for s in group:
                args += [f"{attempt_id}/{s.span_id}", s.to_wire(max_bytes)]
            arg_lists.append(args)
        stored = []
        for ((rollout_id, attempt_id), group), result in zip(
            by_attempt.items(), await self.ctx.each(self._add_spans, arg_lists), strict=True
        ):
            if result[0] == b"missing":
                raise NotFound(f"attempt {attempt_id} of rollout {rollout_id} does not exist")
            for s, seq in zip(group, result[2:], strict=True):
                if seq:
                    stored.append(_with_sequence(s, int(seq)))
        return stored

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
