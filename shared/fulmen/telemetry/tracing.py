"""OpenTelemetry in a runner process: one TracerProvider whose spans are bound to rollout attempts.

Spans land in `SpanBuffer` (and an OTLP collector when set); a rollout is one trace, its id derived
from the rollout id. More: docs/design/telemetry.md.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import logging
import os
import random
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator

from fulmen.records import Span
from fulmen.telemetry import semconv

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Binding:
    """The attempt that the spans of the current context belong to."""

    rollout_id: str
    attempt_id: str


_binding: contextvars.ContextVar[Binding | None] = contextvars.ContextVar("fulmen_binding", default=None)


def current_binding() -> Binding | None:
    return _binding.get()


@contextmanager
def bind(rollout_id: str, attempt_id: str) -> Iterator[Binding]:
    """Spans started inside belong to this attempt (asyncio tasks and `asyncio.to_thread` inherit it)."""
    binding = Binding(rollout_id, attempt_id)
    token = _binding.set(binding)
    try:
        yield binding
    finally:
        _binding.reset(token)


@functools.lru_cache(maxsize=4096)
def rollout_trace_id(rollout_id: str) -> int:
    """The trace id of a rollout: every attempt, and every service that sees the rollout id, agrees."""
    return int.from_bytes(hashlib.blake2b(rollout_id.encode(), digest_size=16).digest(), "big") or 1


class RolloutIdGenerator(IdGenerator):
    """Trace ids come from the bound rollout; span ids stay random."""

    def __init__(self) -> None:
        self._random = random.Random()

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        binding = _binding.get()
        return rollout_trace_id(binding.rollout_id) if binding else (self._random.getrandbits(128) or 1)


_SCALARS = (str, int, float, bool, type(None))


def plain(value: Any) -> Any:
    """OpenTelemetry attribute values (tuples, bounded mappings) as msgpack-friendly lists and dicts."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Mapping):
        return plain_attributes(value)
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    return str(value)


def plain_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    # Hot path (every span): OpenTelemetry has already cleaned the values to scalars or tuples.
    out = dict(attributes)
    for key, value in out.items():
        if not isinstance(value, _SCALARS):
            out[key] = plain(value)
    return out


def to_store_span(span: ReadableSpan, binding: Binding) -> Span:
    ctx = span.context
    parent = span.parent
    return Span(
        rollout_id=binding.rollout_id,
        attempt_id=binding.attempt_id,
        span_id=f"{ctx.span_id:016x}",
        name=span.name,
        trace_id=f"{ctx.trace_id:032x}",
        parent_id=f"{parent.span_id:016x}" if parent is not None else None,
        start_time=span.start_time / 1e9 if span.start_time else None,
        end_time=span.end_time / 1e9 if span.end_time else None,
        status_code=span.status.status_code.name,
        status_message=span.status.description or "",
        attributes=plain_attributes(span.attributes) if span.attributes else {},
        events=[
            {"name": e.name, "timestamp": e.timestamp / 1e9, "attributes": plain(e.attributes or {})}
            for e in span.events
        ]
        if span.events
        else [],
        links=[
            {"trace_id": f"{x.context.trace_id:032x}", "span_id": f"{x.context.span_id:016x}"}
            for x in span.links
        ]
        if span.links
        else [],
    )


class SpanBuffer(SpanProcessor):
    """Binds spans to the current attempt when they start and keeps them, per attempt, when they end.

    `on_end` may run on any thread (sync agents run in worker threads), hence the lock. Spans that
    started outside any attempt are not kept: they belong to no rollout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[Span]] = {}
        self._bindings: dict[str, Binding] = {}
        self.kept = 0

    def on_start(self, span: SdkSpan, parent_context: otel_context.Context | None = None) -> None:
        binding = _binding.get()
        if binding is not None and semconv.ATTEMPT_ID not in (span.attributes or ()):
            span.set_attribute(semconv.ROLLOUT_ID, binding.rollout_id)
            span.set_attribute(semconv.ATTEMPT_ID, binding.attempt_id)

    def on_end(self, span: ReadableSpan) -> None:
        attributes = span.attributes or {}
        attempt_id = attributes.get(semconv.ATTEMPT_ID)
        rollout_id = attributes.get(semconv.ROLLOUT_ID)
        if not isinstance(attempt_id, str) or not isinstance(rollout_id, str):
            return
        self.add(to_store_span(span, Binding(rollout_id, attempt_id)))

    def add(self, record: Span) -> None:
        with self._lock:
            self._pending.setdefault(record.attempt_id, []).append(record)
            self.kept += 1

    def take(self, attempt_id: str | None = None) -> list[Span]:
        """Remove and return the finished spans of one attempt (or of all), in the order they ended."""
        with self._lock:
            if attempt_id is not None:
                return self._pending.pop(attempt_id, [])
            spans = [s for batch in self._pending.values() for s in batch]
            self._pending.clear()
            return spans

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def otlp_exporter_from_env() -> Any | None:
    """An OTLP span exporter when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces variant) is set.

    The protocol follows ``OTEL_EXPORTER_OTLP_PROTOCOL`` (default http/protobuf, as the spec says)."""
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


def setup_tracing(service_name: str, *, set_global: bool = True) -> tuple[TracerProvider, SpanBuffer]:
    """The process's TracerProvider: spans go to a `SpanBuffer` (for the store) and, when configured,
    to OTLP. Set as the global provider so auto-instrumented libraries use it too."""
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}), id_generator=RolloutIdGenerator()
    )
    buffer = SpanBuffer()
    provider.add_span_processor(buffer)
    exporter = otlp_exporter_from_env()
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("exporting spans over OTLP to %s", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    global _tracer, _direct
    _tracer = provider.get_tracer("fulmen")
    _direct = None if exporter is not None else buffer
    if set_global:
        trace.set_tracer_provider(provider)  # OpenTelemetry keeps the first one a process sets
    return provider, buffer


_tracer: trace.Tracer | None = None
_direct: SpanBuffer | None = None  # set when the store is the only consumer of spans
_random = random.Random()


def record_event_span(name: str, attributes: dict[str, Any], error: str | None = None) -> bool:
    """The fast path of ``fulmen.emit_*``: a point-in-time span written straight to the buffer.

    When no exporter other than the store wants spans, the record the store would get is built
    directly (same ids, parent, attributes), for a fraction of the OpenTelemetry SDK's cost per span
    (bench/RESULTS.md). Returns False when the span must go through the SDK (an exporter is configured,
    or no attempt is bound)."""
    buffer = _direct
    binding = _binding.get()
    if buffer is None or binding is None:
        return False
    parent = trace.get_current_span().get_span_context()
    attributes[semconv.ROLLOUT_ID] = binding.rollout_id
    attributes[semconv.ATTEMPT_ID] = binding.attempt_id
    now = time.time()
    buffer.add(
        Span(
            rollout_id=binding.rollout_id,
            attempt_id=binding.attempt_id,
            span_id=f"{_random.getrandbits(64) or 1:016x}",
            name=name,
            trace_id=f"{parent.trace_id if parent.is_valid else rollout_trace_id(binding.rollout_id):032x}",
            parent_id=f"{parent.span_id:016x}" if parent.is_valid else None,
            start_time=now,
            end_time=now,
            status_code="ERROR" if error is not None else "UNSET",
            status_message=error or "",
            attributes=attributes,
        )
    )
    return True


def tracer() -> trace.Tracer:
    """Fulmen's tracer: from the provider `setup_tracing` made last (else the global provider)."""
    return _tracer or trace.get_tracer("fulmen")


def bound_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """``attributes`` plus the current attempt's ids: set at creation, they cost less than
    `SpanBuffer.on_start` adding them one by one afterwards."""
    binding = _binding.get()
    if binding is not None:
        attributes[semconv.ROLLOUT_ID] = binding.rollout_id
        attributes[semconv.ATTEMPT_ID] = binding.attempt_id
    return attributes


class RootSpan:
    """An attempt's root span. When spans are exported (OTLP) it is an SDK span; otherwise only its
    context is real (so the agent's own spans and the emits parent to it) and its record is written
    straight to the buffer when it ends: the SDK's cost per span (bench/RESULTS.md) matters at a
    thousand rollouts/s."""

    def __init__(self, name: str, attributes: dict[str, Any]) -> None:
        binding = _binding.get()
        self._buffer = _direct if binding is not None else None
        self._ended = False
        self._error: str | None = None
        if self._buffer is None or binding is None:
            self.span: trace.Span = tracer().start_span(name, attributes=attributes)
            return
        self._binding = binding
        self._name = name
        self._attributes = attributes
        self._start = time.time()
        context = trace.SpanContext(
            trace_id=rollout_trace_id(binding.rollout_id),
            span_id=_random.getrandbits(64) or 1,
            is_remote=False,
            trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
        )
        self.span = trace.NonRecordingSpan(context)

    def set_error(self, message: str) -> None:
        self._error = message
        if self._buffer is None:
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, message))

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self._buffer is None:
            self.span.end()
            return
        b, ctx = self._binding, self.span.get_span_context()
        attributes = {**self._attributes, semconv.ROLLOUT_ID: b.rollout_id, semconv.ATTEMPT_ID: b.attempt_id}
        self._buffer.add(
            Span(
                rollout_id=b.rollout_id,
                attempt_id=b.attempt_id,
                span_id=f"{ctx.span_id:016x}",
                name=self._name,
                trace_id=f"{ctx.trace_id:032x}",
                parent_id=None,
                start_time=self._start,
                end_time=time.time(),
                status_code="ERROR" if self._error is not None else "UNSET",
                status_message=self._error or "",
                attributes=attributes,
            )
        )
