"""A client's retry of a call the proxy already recorded is the same call, answered from its span.

The span id derives from the ``Idempotency-Key`` and the attempt. Why: docs/design/proxy.md.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any

from fulmen import tokens
from fulmen.records import Span
from fulmen.telemetry import semconv
from fulmen_llm_proxy.backends.base import Call
from fulmen_llm_proxy.errors import bad_request

_KEY_HEADER = semconv.HEADER_IDEMPOTENCY_KEY.encode()
_RETRY_COUNT_HEADER = b"x-stainless-retry-count"
_KEY = re.compile(rb"[\x21-\x7e]{1,255}")  # visible ASCII: it goes into the span and log lines


def call_key(headers: dict[bytes, bytes]) -> str:
    """The request's idempotency key ("" without one); 400 when it is not 1-255 visible ASCII."""
    value = headers.get(_KEY_HEADER)
    if value is None:
        return ""
    if not _KEY.fullmatch(value):
        raise bad_request(f"{semconv.HEADER_IDEMPOTENCY_KEY} must be 1-255 visible ASCII characters")
    return value.decode("ascii")


def keyed_span_id(attempt_id: str, key: str) -> str:
    """The span id of the call ``key`` names in ``attempt_id``: 16 hex digits, as random ones are."""
    return hashlib.blake2b(f"{attempt_id}\0{key}".encode(), digest_size=8).hexdigest()


def choice_key(key: str, index: int) -> str:
    """The call key (or response id) of choice ``index`` of an ``n > 1`` call; choice 0 keeps it."""
    return f"{key}#{index}" if key and index else key


def recorded_choices(call: Call, spans: list[Span]) -> list[Span] | None:
    """The recorded spans of the keyed ``call``'s choices, in order; None unless all are there."""
    by_id = {s.span_id: s for s in spans}
    found = [by_id.get(keyed_span_id(call.attempt_id, choice_key(call.call_key, i))) for i in range(call.n)]
    return None if any(s is None for s in found) else found  # type: ignore[return-value]


def may_be_retry(headers: dict[bytes, bytes]) -> bool:
    """False only for an openai client's first try (retry count 0): nothing can be recorded yet."""
    return headers.get(_RETRY_COUNT_HEADER) != b"0"


def body_of(call: Call, span: Span, more: list[Span] | None = None) -> dict[str, Any]:
    """The recorded response as a non-streaming OpenAI body (with the proxy's token-id fields);
    ``more``: the spans of choices 1.. of an ``n > 1`` call."""
    body = _envelope(call, span, "chat.completion" if call.operation == "chat" else "text_completion")
    body["choices"] = []
    usage = None
    for index, one in enumerate([span, *(more or [])]):
        attributes = one.attributes
        choice: dict[str, Any] = {"index": index, "finish_reason": _finish_reason(attributes), "logprobs": None}
        answer = _answer(attributes)
        if call.operation == "chat":
            choice["message"] = {"role": "assistant", **answer}
        else:
            choice["text"] = answer.get("text", "")
        body["choices"].append(choice)
        got = _add_tokens(body, choice, attributes)
        if usage is not None and got is not None:
            usage["completion_tokens"] += got["completion_tokens"]
            usage["total_tokens"] += got["completion_tokens"]
        else:
            usage = got
    if usage is not None:
        body["usage"] = usage
    return body


def chunks_of(call: Call, span: Span, more: list[Span] | None = None) -> list[dict[str, Any]]:
    """The recorded response as streaming chunks: each choice whole in one chunk (``more``: the
    spans of choices 1.. of an ``n > 1`` call), then usage if asked for."""
    name = "chat.completion.chunk" if call.operation == "chat" else "text_completion"
    chunks = []
    usage = None
    for index, one in enumerate([span, *(more or [])]):
        attributes = one.attributes
        answer = _answer(attributes)
        choice: dict[str, Any] = {"index": index, "finish_reason": _finish_reason(attributes), "logprobs": None}
        if call.operation == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": answer.get("content") or ""}
            if answer.get("tool_calls"):
                # a streamed tool call carries its position, which the client's accumulator keys on
                delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(answer["tool_calls"])]
            choice["delta"] = delta
        else:
            choice["text"] = answer.get("text", "")
        chunk = _envelope(call, span, name)
        chunk["choices"] = [choice]
        got = _add_tokens(chunk, choice, attributes)
        chunk.pop("usage", None)  # usage travels in its own last chunk, as OpenAI streams it
        if index:
            chunk.pop("prompt_token_ids", None)
        if usage is not None and got is not None:
            usage["completion_tokens"] += got["completion_tokens"]
            usage["total_tokens"] += got["completion_tokens"]
        else:
            usage = got
        chunks.append(chunk)
    if call.include_usage and usage is not None:
        last = _envelope(call, span, name)
        last.update(choices=[], usage=usage)
        chunks.append(last)
    return chunks


def _envelope(call: Call, span: Span, obj: str) -> dict[str, Any]:
    attributes = span.attributes
    response_id = attributes.get(semconv.GEN_AI_RESPONSE_ID)
    model = attributes.get(semconv.GEN_AI_RESPONSE_MODEL)
    return {
        "id": response_id if isinstance(response_id, str) and response_id else f"replay-{span.span_id}",
        "object": obj,
        "created": int(span.start_time or time.time()),
        "model": model if isinstance(model, str) and model else call.model,
        "model_version": str(attributes.get(semconv.MODEL_VERSION, "")),
    }


def _answer(attributes: dict[str, Any]) -> dict[str, Any]:
    try:
        answer = json.loads(attributes.get(semconv.RESPONSE_JSON) or "{}")
    except ValueError:
        answer = {}
    return answer if isinstance(answer, dict) else {}


def _finish_reason(attributes: dict[str, Any]) -> str:
    reasons = attributes.get(semconv.GEN_AI_FINISH_REASONS)
    return str(reasons[0]) if isinstance(reasons, list | tuple) and reasons else "stop"


def _add_tokens(
    body: dict[str, Any], choice: dict[str, Any], attributes: dict[str, Any]
) -> dict[str, int] | None:
    """Token ids as the backends send them, and usage; returns the usage (None when unknown)."""
    prompt, response = attributes.get(semconv.PROMPT_TOKEN_IDS), attributes.get(semconv.RESPONSE_TOKEN_IDS)
    if prompt is not None:
        body["prompt_token_ids"] = tokens.ids(prompt)
    if response is not None:
        choice["token_ids"] = tokens.ids(response)
    n_in, n_out = attributes.get(semconv.GEN_AI_INPUT_TOKENS), attributes.get(semconv.GEN_AI_OUTPUT_TOKENS)
    if not isinstance(n_in, int) or not isinstance(n_out, int):
        return None
    usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
    body["usage"] = usage
    return usage
