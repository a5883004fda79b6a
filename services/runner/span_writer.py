"""Moves finished spans from the process's `SpanBuffer` to the store, in batches.

`flush(attempt_id)` returns only once all of that attempt's spans are stored; the final reward is
computed here, once; a span the store refuses leaves a `fulmen.dropped` span and a dead letter in
its place. Why: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fulmen.errors import FulmenError, NotFound, RecordError, RetryableError
from fulmen.records import Span
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.telemetry.semconv import (
    DROPPED_LIMIT_BYTES,
    DROPPED_NAME,
    DROPPED_REASON,
    DROPPED_SIZE_BYTES,
    DROPPED_SPAN,
)
from fulmen.telemetry.tracing import SpanBuffer

log = logging.getLogger(__name__)

DROPPED_NAME_CHARS = 256  # of the dropped span's name kept on the marker (a name can be the oversize part)


class SpanWriter:
    def __init__(self, store: RedisStore, buffer: SpanBuffer, interval_s: float = 0.25) -> None:
        self.store = store
        self.buffer = buffer
        self.interval_s = interval_s
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self.written = 0
        self.dropped = 0
        self._rewards: dict[str, tuple[float, int, float]] = {}  # attempt -> (time, order, reward)
        self._order = itertools.count()

    def _take(self, attempt_id: str | None = None) -> list[Span]:
        spans = self.buffer.take(attempt_id)
        self._note_rewards(spans)
        return spans

    def _note_rewards(self, spans: Iterable[Span]) -> None:
        for s in spans:
            attributes = s.attributes
            if attributes.get(semconv.SPAN_KIND) != semconv.KIND_REWARD and s.name != semconv.REWARD_SPAN:
                continue
            value = attributes.get(semconv.REWARD)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue  # the adapter skips such an attempt as malformed; it is no reward
            key = (s.start_time if s.start_time is not None else math.inf, next(self._order), float(value))
            best = self._rewards.get(s.attempt_id)
            if best is None or key[:2] > best[:2]:
                self._rewards[s.attempt_id] = key

    def final_reward(self, attempt_id: str) -> float | None:
        """The attempt's final reward among the spans taken so far (None: it emitted none); forgets it."""
        best = self._rewards.pop(attempt_id, None)
        return None if best is None else best[2]

    async def flush(self, attempt_id: str) -> None:
        """Store every finished span of one attempt (waiting for a periodic write that holds some)."""
        while (pending := self._inflight.get(attempt_id)) is not None:
            await asyncio.shield(pending)
        spans = self._take(attempt_id)  # no await since the check: nobody took them in between
        if spans:
            await self._write(spans)

    async def drain(self, attempt_id: str) -> list[Span]:
        """Take (without writing) the attempt's spans not yet stored, once no periodic write holds any
        of them: the caller stores them itself, with the attempt's final status in one step."""
        while (pending := self._inflight.get(attempt_id)) is not None:
            await asyncio.shield(pending)
        return self._take(attempt_id)

    async def write(self, spans: Sequence[Span]) -> None:
        """Store spans now (any the store refuses leaves a trace in its place: `_write`)."""
        if spans:
            await self._write(spans)

    async def flush_all(self) -> None:
        spans = self._take()
        if not spans:
            return
        attempts = {s.attempt_id for s in spans}
        future = asyncio.ensure_future(self._write(spans))
        for a in attempts:
            self._inflight[a] = future
        try:
            await asyncio.shield(future)
        finally:
            for a in attempts:
                if self._inflight.get(a) is future:
                    del self._inflight[a]

    async def run(self) -> None:
        """The periodic flush; runs until cancelled, and never dies of a failed write."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush_all()
            except Exception:
                log.exception("periodic span flush failed; will try again")

    async def _write(self, spans: Sequence[Span]) -> None:
        """Write a batch; a span the store refuses is dropped, never blocking the others: too large or
        not encodable, it leaves a `fulmen.dropped` span and a dead letter (`_mark_dropped`); of an
        attempt gone, a log line. A lost connection is retried until it comes back."""
        delay = 0.1
        while True:
            try:
                await self.store.spans.record_spans(spans)
                self.written += len(spans)
                return
            except (RedisConnectionError, RedisTimeoutError, RetryableError) as e:
                log.warning("writing %d spans failed (%s); retrying in %.1f s", len(spans), e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            except (FulmenError, NotFound):
                break  # a bad span in the batch: write them one by one below
        for span in spans:
            try:
                await self.store.spans.record_spans([span])
                self.written += 1
            except RecordError as e:
                await self._mark_dropped(span, e)
            except FulmenError as e:
                self.dropped += 1
                log.error(
                    "span %r of attempt %s dropped: %s", span.name, span.attempt_id, e
                )

    async def _mark_dropped(self, span: Span, error: RecordError) -> None:
        """Leave a trace of a span the store refused: a small `DROPPED_SPAN` in its place on the same
        attempt, and a dead letter with the reason (sourced at the rollout's spans stream, with no
        payload: there is nothing to requeue). A failure here is logged, never raised."""
        self.dropped += 1
        limit = self.store.max_record_bytes
        size = _encoded_size(span)
        name = span.name[:DROPPED_NAME_CHARS]
        reason = (
            f"span {name!r} ({'?' if size is None else size} bytes) of attempt {span.attempt_id} "
            f"of rollout {span.rollout_id} dropped: {error}"
        )
        attributes: dict[str, Any] = {
            semconv.ROLLOUT_ID: span.rollout_id, semconv.ATTEMPT_ID: span.attempt_id,
            DROPPED_NAME: name, DROPPED_LIMIT_BYTES: limit, DROPPED_REASON: str(error),
        }
        if size is not None:
            attributes[DROPPED_SIZE_BYTES] = size
        marker = Span(
            span.rollout_id, span.attempt_id, span.span_id, DROPPED_SPAN, span.trace_id, span.parent_id,
            span.start_time, span.end_time, attributes=attributes,
        )
        try:
            await self.store.spans.record_spans([marker])
        except (RedisError, FulmenError) as e:
            log.error("%s; its %s span was not stored either: %s", reason, DROPPED_SPAN, e)
        try:  # Stream.dead_letter logs the reason
            await self.store.dead_letters.dead_letter(
                self.store.keys.spans(span.rollout_id), f"{span.attempt_id}/{span.span_id}", reason, {}
            )
        except (RedisError, FulmenError) as e:
            log.error("%s; no dead letter written: %s", reason, e)


def _encoded_size(span: Span) -> int | None:
    """The span's record size in bytes, without the limit; None if it cannot be encoded at all."""
    try:
        return len(span.to_wire(sys.maxsize))
    except RecordError:
        return None
