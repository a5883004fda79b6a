"""The proxy as a plain ASGI app: no framework between uvicorn and the handlers.

Routes: the OpenAI, Responses and Messages APIs (each a `fulmen_llm_proxy.api.dialects.Dialect`), models,
health and metrics. Each call's span is stored before its response is sent. Why: docs/design/proxy.md.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from fulmen.errors import NotFound, RecordTooLarge
from fulmen.telemetry import semconv
from fulmen_llm_proxy.api import json_body
from fulmen_llm_proxy.api.dialects import OPENAI_CHAT, OPENAI_COMPLETIONS, Dialect, Parsed
from fulmen_llm_proxy.api.messages import MESSAGES
from fulmen_llm_proxy.api.responses import RESPONSES
from fulmen_llm_proxy.attribution import Target, from_headers, new_span_id, split_path, trace_context
from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.errors import ProxyError
from fulmen_llm_proxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from fulmen_llm_proxy.recording import Exchange, build_spans
from fulmen_llm_proxy.replay import (
    body_of,
    call_key,
    chunks_of,
    keyed_span_id,
    may_be_retry,
    recorded_choices,
)
from fulmen_llm_proxy.service import ProxyService

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_VERSION_HEADER = semconv.HEADER_MODEL_VERSION.encode()
_PURPOSE_HEADER = semconv.HEADER_PURPOSE.encode()
_DIALECTS: dict[str, Dialect] = {
    "/chat/completions": OPENAI_CHAT, "/completions": OPENAI_COMPLETIONS,
    "/responses": RESPONSES, "/messages": MESSAGES,
}  # fmt: skip
# A scope extension of the proxy's own server: respond(status, headers, body) writes a whole response
# (its headers include its content-length) and returns True, or returns False when it cannot (the
# response has started, writing is paused, a HEAD request): then it goes as ASGI messages.
RESPOND = "fulmen.respond"
Respond = Callable[[int, list[tuple[bytes, bytes]], bytes], bool]
CLIENT_CLOSED = 499  # nginx's "client closed request": the status logged when nothing was answered


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class ProxyApp:
    """ASGI callable; the lifespan starts and stops the `ProxyService`."""

    def __init__(self, service: ProxyService) -> None:
        self.service = service
        self.max_request_bytes = service.settings.max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.service.start()
                except Exception as e:
                    log.exception("llm-proxy could not start")
                    await send({"type": "lifespan.startup.failed", "message": f"{type(e).__name__}: {e}"})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.service.close()
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return

    # --- routing ------------------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        out = Out(scope, send)
        endpoint = "other"
        status = 500
        dialect: Dialect = OPENAI_CHAT  # whose error shape an error takes
        try:
            target = split_path(scope["path"])
            route = target.path[3:] if target.path.startswith("/v1/") else target.path
            found = _DIALECTS.get(route)
            if found is not None:
                endpoint, dialect = route, found
                if scope["method"] != "POST":
                    raise ProxyError(405, f"use POST for {route}")
                headers = dict(scope["headers"])
                self._authorize(headers)
                from_headers(target, headers)
                status = await self._completion(receive, out, target, headers, dialect)
            elif route == "/models":
                endpoint = route
                self._authorize(dict(scope["headers"]))
                status = await self._models(out)
            elif target.path == "/healthz":
                endpoint, status = "/healthz", 200
                await out.body(200, b'{"status":"ok"}')
            elif target.path == "/readyz":
                endpoint = "/readyz"
                ready = await self.service.ready()
                status = 200 if ready else 503
                waiting = getattr(self.service, "waiting", None)  # the model version it must serve first
                body = {"ready": ready, **({"waiting": waiting} if waiting else {})}
                await out.body(status, json.dumps(body, separators=(",", ":")).encode())
            elif target.path == "/metrics":
                endpoint, status = "/metrics", 200
                await out.body(200, self.service.metrics.render(), METRICS_CONTENT_TYPE)
            else:
                raise ProxyError(404, f"no route {scope['method']} {scope['path']}", code="unknown_route")
        except ProxyError as e:
            status = e.status
            await out.body(e.status, dialect.error_body(e))
        except ClientGone:
            status = CLIENT_CLOSED
        except Exception as e:  # a bug must cost one request, never the server
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            status = 500
            await out.body(500, dialect.error_body(ProxyError(500, f"internal error: {type(e).__name__}")))
        self.service.metrics.observe(endpoint, status, time.perf_counter() - started)

    def _authorize(self, headers: dict[bytes, bytes]) -> None:
        keys = self.service.api_keys
        if not keys:
            return
        given = headers.get(b"authorization", b"")
        # the anthropic client sends its key as x-api-key
        token = given[7:].strip() if given[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        # Compare with every key, in constant time each, so timing says nothing about which matched.
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(token, key)
        if not matched:
            raise ProxyError(
                401, "missing or invalid API key (Authorization: Bearer <key>, or x-api-key)", code="invalid_api_key"
            )

    async def _models(self, out: Out) -> int:
        now = int(time.time())
        version = self.service.backend.model_version
        data = [
            {"id": name, "object": "model", "created": now, "owned_by": "fulmen", "model_version": version}
            for name in self.service.backend.model_names
        ]
        await out.body(200, json.dumps({"object": "list", "data": data}).encode())
        return 200

    # --- the completion routes (every dialect) -------------------------------------------------------

    async def _completion(
        self, receive: Receive, out: Out, target: Target, headers: dict[bytes, bytes], dialect: Dialect
    ) -> int:
        service = self.service
        start_time = time.time()
        parsed = dialect.parse(await self._read_body(receive, headers), service.default_model)
        call, raw = parsed.call, parsed.record
        call.api = dialect.api
        names = service.backend.model_names
        if names and call.model not in names:
            raise ProxyError(
                404, f"model {call.model!r} is not served here; available: {', '.join(names)}",
                param="model", code="model_not_found",
            )  # fmt: skip
        call.rollout_id, call.attempt_id = target.rollout_id, target.attempt_id
        call.call_key = call_key(headers)
        if not call.rollout_id:
            service.metrics.unattributed.inc()
        elif call.call_key and may_be_retry(headers) and await self._replay(out, parsed, dialect):
            return 200
        await service.gate.enter()
        service.metrics.in_flight.inc()
        try:
            result = Result()
            if call.stream:
                await self._stream(out.send, parsed, dialect, result, headers, start_time)
            else:
                body = await service.backend.complete(call, result)
                body["model_version"] = result.model_version
                answer = dialect.body(body, parsed)
                # an upstream's answer as read (`json_body`); a local backend's may hold a NaN of its own
                payload = (json_body.dumps(answer) if getattr(service.backend, "parsed_answers", False)
                           else json.dumps(answer).encode())
                await self._record(call, result, raw, headers, start_time)
                await out.body(200, payload, version=result.model_version)
        finally:
            service.metrics.in_flight.dec()
            service.gate.leave()
        if result.input_tokens:
            service.metrics.prompt_tokens.inc(result.input_tokens)
        if result.output_tokens:
            service.metrics.completion_tokens.inc(result.output_tokens)
        return 200

    async def _stream(
        self,
        send: Send,
        parsed: Parsed,
        dialect: Dialect,
        result: Result,
        headers: dict[bytes, bytes],
        start_time: float,
    ) -> None:
        """Send each chunk when the next one exists, so the last one can wait for the span write."""
        call = parsed.call
        encoder = dialect.encoder(parsed)
        pending: bytes | None = None
        started = False
        try:
            async for chunk in self.service.backend.stream(call, result):
                chunk["model_version"] = result.model_version
                if pending is None and not started:
                    started = True
                    version = result.model_version.encode()
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 200,
                            "headers": [*_SSE, (_VERSION_HEADER, version)],
                        }
                    )
                elif pending:
                    await send({"type": "http.response.body", "body": pending, "more_body": True})
                pending = encoder.chunk(chunk)
        except ProxyError as e:
            if not started:
                raise
            # Headers are gone: the error travels as an SSE event (the openai client raises it).
            log.warning("stream of %s failed after its start: %s", call.model, e.message)
            await send({"type": "http.response.body", "body": encoder.error(e), "more_body": False})
            return
        if not started:
            raise ProxyError(502, "the backend produced no output", code="empty_stream")
        await self._record(call, result, parsed.record, headers, start_time)
        await send({"type": "http.response.body", "body": (pending or b"") + encoder.end(result), "more_body": False})

    async def _replay(self, out: Out, parsed: Parsed, dialect: Dialect) -> bool:
        """Answer a retried call from its recorded span (`fulmen_llm_proxy.replay`); False when the
        call was not recorded (then it is served as a new one)."""
        call = parsed.call
        span_id = keyed_span_id(call.attempt_id, call.call_key)
        store = self.service.store
        assert store is not None
        try:
            spans = await store.spans.query_spans(call.rollout_id, call.attempt_id)
        except NotFound:
            return False  # no such rollout: served (unrecorded), as any call for an unknown attempt
        except (RedisError, OSError) as e:
            raise ProxyError(
                503,
                f"could not look up the call's record ({type(e).__name__}); retry",
                code="store_unavailable",
            ) from None
        choices = recorded_choices(call, spans)  # one span per choice of an n > 1 call
        if choices is None:
            return False
        span, more = choices[0], choices[1:]
        log.info("call %s of attempt %s answered from its record (a client retry)", span_id, call.attempt_id)
        version = span.attributes.get(semconv.MODEL_VERSION, "")
        if not call.stream:
            body = dialect.body(body_of(call, span, more), parsed)
            await out.body(200, json.dumps(body).encode(), version=str(version))
            return True
        await out.send({"type": "http.response.start", "status": 200,
                        "headers": [*_SSE, (_VERSION_HEADER, str(version).encode())]})  # fmt: skip
        encoder = dialect.encoder(parsed)
        events = b"".join(encoder.chunk(c) for c in chunks_of(call, span, more))
        await out.send({"type": "http.response.body", "body": events + encoder.end(Result()), "more_body": False})
        return True

    async def _record(
        self, call: Call, result: Result, raw: bytes, headers: dict[bytes, bytes], start_time: float
    ) -> None:
        """Store the call's span (attributed calls only). A store that cannot be reached fails the
        call (503, retryable): serving it would let its attempt succeed without the span."""
        if not call.rollout_id:
            return
        trace_id, parent_id = trace_context(headers.get(b"traceparent"), call.rollout_id)
        spans = build_spans(
            call, result,
            span_id=keyed_span_id(call.attempt_id, call.call_key) if call.call_key else new_span_id(),
            exchange=Exchange(system=self.service.backend.system, raw_request=raw, trace_id=trace_id,
                              parent_id=parent_id, start_time=start_time, end_time=time.time(),
                              purpose=headers.get(_PURPOSE_HEADER)),
        )  # fmt: skip
        if self.service.otlp is not None:
            for span in spans:
                self.service.otlp.export(span)
        store = self.service.store
        assert store is not None
        try:
            await store.spans.record_spans(spans)
        except NotFound:
            # No such attempt: nothing can succeed without this span, so the call is served anyway.
            self.service.metrics.span_failures.labels("unknown_attempt").inc()
            log.warning(
                "call for unknown attempt %s of rollout %s: span not stored", call.attempt_id, call.rollout_id
            )
        except RecordTooLarge:
            self.service.metrics.span_failures.labels("too_large").inc()
            raise ProxyError(
                413, "the call's span exceeds FULMEN_MAX_RECORD_BYTES; shorten the conversation",
                code="span_too_large",
            ) from None  # fmt: skip
        except (RedisError, OSError) as e:
            self.service.metrics.span_failures.labels("store_unavailable").inc()
            raise ProxyError(
                503, f"could not record the call ({type(e).__name__}); retry", code="store_unavailable"
            ) from None

    async def _read_body(self, receive: Receive, headers: dict[bytes, bytes]) -> bytes:
        limit = self.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body: bytes = message.get("body", b"")
        if not message.get("more_body"):
            return body  # the common case: the whole body in one message
        parts = [body]
        size = len(body)
        while message.get("more_body"):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            parts.append(chunk)
        return b"".join(parts)


def _too_large(limit: int) -> ProxyError:
    return ProxyError(
        413, f"request body over {limit} bytes (FULMEN_MAX_REQUEST_BYTES)", code="request_too_large"
    )


class Out:
    """Where a request's response goes: the ASGI ``send``, and, under the proxy's own server
    (`fulmen_llm_proxy.server`), its scope's `RESPOND` extension, which writes a whole response with a
    length in one call and one write instead of two ASGI messages."""

    __slots__ = ("respond", "send")

    def __init__(self, scope: Scope, send: Send) -> None:
        self.send = send
        extensions = scope.get("extensions")
        self.respond: Respond | None = extensions.get(RESPOND) if extensions else None

    async def body(self, status: int, body: bytes, content_type: bytes = b"application/json",
                   version: str | None = None) -> None:
        """Send a whole response: ``body`` with its type, length and (a completion's) model version."""
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
        if version is not None:
            headers.append((_VERSION_HEADER, version.encode()))
        if self.respond is not None and self.respond(status, headers, body):
            return
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})
