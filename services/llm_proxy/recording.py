"""The span of one LLM call: OpenTelemetry GenAI attributes plus Fulmen's token-level ones.

Stored *before* the response goes back; also sent to an OTLP collector when one is set.
Why: docs/design/proxy.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from fulmen import tokens
from fulmen.records import Span
from fulmen.telemetry import semconv
from fulmen.telemetry.tracing import otlp_exporter_from_env
from fulmen_llm_proxy.api import json_body
from fulmen_llm_proxy.attribution import new_span_id
from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.replay import choice_key, keyed_span_id

log = logging.getLogger(__name__)
SERVICE_NAME = "fulmen-llm-proxy"
# The API the agent called when it was not OpenAI's chat or completions (the span's request is the
# chat request it was translated into, so every reader handles it as a chat call).
API_ATTRIBUTE = "fulmen.api"
MAX_PURPOSE_BYTES = 64  # of a call's purpose header kept in its span


@dataclass(frozen=True, slots=True)
class Exchange:
    """What every span of one call shares: the backend that served it, the body as the agent sent
    it, the trace it belongs to, when it ran and how it ended."""

    system: str
    raw_request: bytes
    trace_id: str
    parent_id: str | None
    start_time: float
    end_time: float
    status_code: str = "OK"
    status_message: str = ""
    purpose: bytes | None = None  # the request's x-fulmen-purpose header (a judge's call), as sent


def build_span(call: Call, result: Result, span_id: str, exchange: Exchange) -> Span:
    """One `Span` bound to the call's attempt (the caller checks that the call is attributed)."""
    return Span(
        rollout_id=call.rollout_id,
        attempt_id=call.attempt_id,
        span_id=span_id,
        name=f"{call.operation} {call.model}",
        trace_id=exchange.trace_id,
        parent_id=exchange.parent_id,
        start_time=exchange.start_time,
        end_time=exchange.end_time,
        status_code=exchange.status_code,
        status_message=exchange.status_message,
        attributes=_attributes(call, result, exchange),
        resource={"service.name": SERVICE_NAME},
    )


def _attributes(call: Call, result: Result, exchange: Exchange) -> dict[str, Any]:
    """The span's attributes: what the call asked for, then (`_add_answer`) what it got."""
    attributes: dict[str, Any] = {
        semconv.ROLLOUT_ID: call.rollout_id,
        semconv.ATTEMPT_ID: call.attempt_id,
        semconv.SPAN_KIND: semconv.KIND_LLM_CALL,
        semconv.GEN_AI_OPERATION: call.operation,
        semconv.GEN_AI_SYSTEM: exchange.system,
        semconv.GEN_AI_REQUEST_MODEL: call.model,
        semconv.GEN_AI_RESPONSE_MODEL: result.response_model or call.model,
        semconv.GEN_AI_TEMPERATURE: call.temperature,
        semconv.GEN_AI_TOP_P: call.top_p,
        semconv.MODEL_VERSION: result.model_version,
        semconv.TOKEN_FIDELITY: result.fidelity,
        semconv.STREAM: call.stream,
        semconv.LATENCY_MS: round((exchange.end_time - exchange.start_time) * 1000, 3),
        # The body as the agent sent it: messages or prompt, tools, every sampling parameter.
        semconv.REQUEST_JSON: exchange.raw_request.decode("utf-8", "replace"),
    }
    if result.response_id:
        attributes[semconv.GEN_AI_RESPONSE_ID] = result.response_id
    if call.call_key:
        attributes[semconv.CALL_KEY] = call.call_key
    if call.api:
        attributes[API_ATTRIBUTE] = call.api
    if exchange.purpose:
        # latin-1 decodes any bytes; the length is capped: the value is the client's, the span the store's
        attributes[semconv.CALL_PURPOSE] = exchange.purpose[:MAX_PURPOSE_BYTES].decode("latin-1")
    if call.max_tokens is not None:
        attributes[semconv.GEN_AI_MAX_TOKENS] = call.max_tokens
    if call.seed is not None:
        attributes[semconv.GEN_AI_SEED] = call.seed
    _add_answer(attributes, call, result, exchange.system)
    return attributes


def _add_answer(attributes: dict[str, Any], call: Call, result: Result, system: str) -> None:
    """Adds the answer's attributes: why it finished, its token counts, ids and log-probabilities, its body."""
    if result.finish_reason:
        attributes[semconv.GEN_AI_FINISH_REASONS] = [result.finish_reason]
    if result.finish_reason == "length":
        attributes[semconv.TRUNCATED_BY] = truncation(call, result, system)
    if result.input_tokens is not None:
        attributes[semconv.GEN_AI_INPUT_TOKENS] = result.input_tokens
    if result.output_tokens is not None:
        attributes[semconv.GEN_AI_OUTPUT_TOKENS] = result.output_tokens
    # packed arrays, not lists: the adapter decodes every span's ids (see fulmen.tokens)
    if result.prompt_token_ids is not None:
        attributes[semconv.PROMPT_TOKEN_IDS] = tokens.pack_ids(result.prompt_token_ids)
    if result.token_ids is not None:
        attributes[semconv.RESPONSE_TOKEN_IDS] = tokens.pack_ids(result.token_ids)
    if result.logprobs is not None:
        attributes[semconv.RESPONSE_LOGPROBS] = tokens.pack_floats(result.logprobs)
    response = result.message() if call.operation == "chat" else {"text": result.text}
    attributes[semconv.RESPONSE_JSON] = json_body.dumps(response).decode()


_WARNED: set[str] = set()  # the causes already logged: one warning per cause per process


def truncation(call: Call, result: Result, system: str = "") -> str:
    """What cut an answer that finished with "length" (the backend's word, else inferred: max tokens
    when the answer reached the call's, or always from Anthropic, which sends one when the call sets
    none; else the model's context); logged once per cause."""
    reached = call.max_tokens is not None and (result.output_tokens or 0) >= call.max_tokens
    cause = result.truncated_by or ("max_tokens" if reached or system == "anthropic" else "context_length")
    if cause not in _WARNED:
        _WARNED.add(cause)
        fix = ("raise the call's max_tokens, or the proxy's default for calls that set none (--default-max-tokens, "
               "FULMEN_DEFAULT_MAX_TOKENS; --upstream-max-tokens for anthropic)" if cause == "max_tokens" else
               "serve a model with a longer context (max_position_embeddings), or send shorter prompts")
        log.warning("an answer was cut by %s (rollout %s, %s prompt + %s answer tokens): %s. Every cut call's span "
                    "says so (%s); this is logged once per cause", cause, call.rollout_id or "-", result.input_tokens,
                    result.output_tokens, fix, semconv.TRUNCATED_BY)
    return cause


def build_spans(call: Call, result: Result, *, span_id: str, exchange: Exchange) -> list[Span]:
    """The call's spans: `build_span` of choice 0 (``result``), then one per further choice of an
    ``n > 1`` call (``result.more``), each with its own token ids, so the adapter gets every sample.
    A further choice's span id is keyed on its call key like choice 0's (a retry finds them all),
    else random."""
    spans = [build_span(call, result, span_id, exchange)]
    for index, more in enumerate(result.more, 1):
        key = choice_key(call.call_key, index)
        sid = keyed_span_id(call.attempt_id, key) if key else new_span_id()
        span = build_span(replace(call, call_key=key), replace(more, response_id=choice_key(more.response_id, index)),
                          sid, exchange)  # fmt: skip
        span.attributes[semconv.CHOICE_INDEX] = index
        spans.append(span)
    if result.more:
        spans[0].attributes[semconv.CHOICE_INDEX] = 0
    return spans


_STATUS = {"OK": trace.StatusCode.OK, "ERROR": trace.StatusCode.ERROR}


class OtlpExport:
    """Sends the proxy's call spans to an OTLP collector through a `BatchSpanProcessor`.

    The span record already holds everything (ids from ``traceparent``, times, GenAI attributes), so
    it becomes a `ReadableSpan` directly rather than going through a tracer a second time; `export`
    only appends to the processor's queue, and the batch goes out on the processor's thread. Exists
    only when an endpoint is configured: with none, the proxy pays nothing for it."""

    def __init__(self, exporter: Any) -> None:
        self._processor = BatchSpanProcessor(exporter)
        self._resource = Resource.create({"service.name": SERVICE_NAME})
        self._scope = InstrumentationScope("fulmen_llm_proxy")

    @classmethod
    def from_env(cls) -> OtlpExport | None:
        exporter = otlp_exporter_from_env()
        if exporter is None:
            return None
        log.info("exporting LLM call spans over OTLP to %s", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
        return cls(exporter)

    def export(self, span: Span) -> None:
        self._processor.on_end(self.readable(span))

    def readable(self, span: Span) -> ReadableSpan:
        sampled = trace.TraceFlags(trace.TraceFlags.SAMPLED)
        trace_id = int(span.trace_id, 16)
        context = trace.SpanContext(trace_id, int(span.span_id, 16), is_remote=False, trace_flags=sampled)
        parent = (
            trace.SpanContext(trace_id, int(span.parent_id, 16), is_remote=True, trace_flags=sampled)
            if span.parent_id
            else None
        )
        # The packed token ids and log-probabilities are training data, opaque bytes in a trace
        # viewer, and the bulk of the span: they stay in the store only. None is no OTLP value.
        attributes = {
            k: v for k, v in span.attributes.items() if v is not None and not isinstance(v, bytes | bytearray)
        }
        code = _STATUS.get(span.status_code, trace.StatusCode.UNSET)
        # OpenTelemetry keeps a description on ERROR only (and warns otherwise).
        status = trace.Status(code, span.status_message or None if code is trace.StatusCode.ERROR else None)
        return ReadableSpan(
            name=span.name,
            context=context,
            parent=parent,
            resource=self._resource,
            attributes=attributes,
            kind=trace.SpanKind.SERVER,  # the proxy serves the agent's call
            instrumentation_scope=self._scope,
            status=status,
            start_time=int((span.start_time or 0) * 1e9),
            end_time=int((span.end_time or 0) * 1e9),
        )

    def close(self) -> None:
        """Flush what is queued and stop the export thread (blocks up to the exporter's timeout)."""
        self._processor.shutdown()
