"""The span of one LLM call: OpenTelemetry GenAI attributes plus Fulmen's token-level ones.

The app stores it with ``store.add_spans`` *before* the response (or the last stream chunk) goes
back, so a succeeded attempt always has all of its LLM spans. ``add_spans`` goes through the store's
auto-pipeline: the spans of concurrent calls share one Redis round trip.
"""

from __future__ import annotations

import json
from typing import Any

from fulmen import semconv, tokens
from fulmen.records import Span
from fulmen_llm_proxy.backends import Call, Result


def build_span(
    call: Call,
    result: Result,
    *,
    system: str,
    raw_request: bytes,
    span_id: str,
    trace_id: str,
    parent_id: str | None,
    start_time: float,
    end_time: float,
    status_code: str = "OK",
    status_message: str = "",
) -> Span:
    """One `Span` bound to the call's attempt (the caller checks that the call is attributed)."""
    attributes: dict[str, Any] = {
        semconv.ROLLOUT_ID: call.rollout_id,
        semconv.ATTEMPT_ID: call.attempt_id,
        semconv.SPAN_KIND: semconv.KIND_LLM_CALL,
        semconv.GEN_AI_OPERATION: call.operation,
        semconv.GEN_AI_SYSTEM: system,
        semconv.GEN_AI_REQUEST_MODEL: call.model,
        semconv.GEN_AI_RESPONSE_MODEL: result.response_model or call.model,
        semconv.GEN_AI_TEMPERATURE: call.temperature,
        semconv.GEN_AI_TOP_P: call.top_p,
        semconv.MODEL_VERSION: result.model_version,
        semconv.TOKEN_FIDELITY: result.fidelity,
        semconv.STREAM: call.stream,
        semconv.LATENCY_MS: round((end_time - start_time) * 1000, 3),
        # The body as the agent sent it: messages or prompt, tools, every sampling parameter.
        semconv.REQUEST_JSON: raw_request.decode("utf-8", "replace"),
    }
    if result.response_id:
        attributes[semconv.GEN_AI_RESPONSE_ID] = result.response_id
    if call.max_tokens is not None:
        attributes[semconv.GEN_AI_MAX_TOKENS] = call.max_tokens
    if call.seed is not None:
        attributes[semconv.GEN_AI_SEED] = call.seed
    if result.finish_reason:
        attributes[semconv.GEN_AI_FINISH_REASONS] = [result.finish_reason]
    if result.input_tokens is not None:
        attributes[semconv.GEN_AI_INPUT_TOKENS] = result.input_tokens
    if result.output_tokens is not None:
        attributes[semconv.GEN_AI_OUTPUT_TOKENS] = result.output_tokens
    # packed arrays, not lists: see fulmen.tokens (the adapter reads thousands of these a second)
    if result.prompt_token_ids is not None:
        attributes[semconv.PROMPT_TOKEN_IDS] = tokens.pack_ids(result.prompt_token_ids)
    if result.token_ids is not None:
        attributes[semconv.RESPONSE_TOKEN_IDS] = tokens.pack_ids(result.token_ids)
    if result.logprobs is not None:
        attributes[semconv.RESPONSE_LOGPROBS] = tokens.pack_floats(result.logprobs)
    response = result.message() if call.operation == "chat" else {"text": result.text}
    attributes[semconv.RESPONSE_JSON] = json.dumps(response, ensure_ascii=False)
    return Span(
        rollout_id=call.rollout_id,
        attempt_id=call.attempt_id,
        span_id=span_id,
        name=f"{call.operation} {call.model}",
        trace_id=trace_id,
        parent_id=parent_id,
        start_time=start_time,
        end_time=end_time,
        status_code=status_code,
        status_message=status_message,
        attributes=attributes,
        resource={"service.name": "fulmen-llm-proxy"},
    )
