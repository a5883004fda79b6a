"""A fake OTLP/HTTP collector on loopback: accepts ``POST /v1/traces`` (protobuf, gzip or not), decodes
each ``ExportTraceServiceRequest`` with opentelemetry-proto and keeps the spans, flattened.

Use it in tests::

    with OtlpReceiver() as receiver:               # serves from a thread
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint   # http://127.0.0.1:<port>
        ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 9, timeout_s=30)

``receiver.spans`` is every `ReceivedSpan` so far, in arrival order; ``receiver.requests`` counts the
export requests. JSON-encoded OTLP (``application/json``) is refused with 415, as the exporter in
this project sends protobuf.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector saw it; ids as lower-case hex, like OTLP/JSON and the store."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    attributes: dict[str, Any]
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""
    status_code: int = 0  # 0 unset, 1 ok, 2 error (opentelemetry.proto.trace.v1.Status)

    @property
    def trace_id_int(self) -> int:
        return int(self.trace_id, 16)


def any_value(value: AnyValue) -> Any:
    """An OTLP ``AnyValue`` as a plain Python value."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def decode_spans(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        name=s.name,
                        attributes={kv.key: any_value(kv.value) for kv in s.attributes},
                        resource=resource,
                        scope=scope_spans.scope.name,
                        status_code=int(s.status.code),
                    )
                )
    return spans


class OtlpReceiver:
    """The collector; `start` / `stop`, or use it as a context manager."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path.rstrip("/") != "/v1/traces":
                    self._reply(404, b"")
                    return
                if "protobuf" not in (self.headers.get("content-type") or ""):
                    self._reply(415, b"")
                    return
                encoding = (self.headers.get("content-encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                request = ExportTraceServiceRequest()
                try:
                    request.ParseFromString(body)
                except Exception:
                    self._reply(400, b"")
                    return
                receiver._add(decode_spans(request))
                self._reply(200, ExportTraceServiceResponse().SerializeToString())

            def _reply(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        """The value for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the exporter appends ``/v1/traces``)."""
        return f"http://127.0.0.1:{self.port}"

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self.spans.extend(spans)
            self.requests += 1
            self._changed.notify_all()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._changed:
            return list(self.spans)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """Block until ``predicate(spans)`` holds (woken by each export); return the spans. Raises
        TimeoutError if it still does not hold after ``timeout_s``."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self.spans), timeout_s):
                raise TimeoutError(f"after {timeout_s} s the receiver holds {len(self.spans)} span(s)")
            return list(self.spans)

    def start(self) -> OtlpReceiver:
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(10)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
