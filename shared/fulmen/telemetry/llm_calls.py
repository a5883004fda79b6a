"""An LLM-call span as a person reads it: the messages sent, the text and tool calls answered, token
counts, log-probabilities, the model version that served it and its latency.

The proxy records the request body and the response message as JSON text and the tokens as packed
arrays (`fulmen.telemetry.semconv`); `fulmen run-once` and the dashboard both show calls through `describe`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fulmen import tokens
from fulmen.telemetry import semconv


@dataclass(frozen=True, slots=True)
class LlmCall:
    messages: list[dict[str, Any]]  # chat: as sent; a completion's prompt becomes one "prompt" message
    response_text: str
    tool_calls: list[dict[str, Any]]
    prompt_tokens: int
    response_tokens: int
    logprobs: list[float]
    response_token_ids: list[int]
    model_version: str | None
    latency_ms: float | None
    finish_reasons: list[str] = field(default_factory=list)
    request_model: str | None = None

    @property
    def prompt_text(self) -> str:
        """The last message sent (what the model answered), as text."""
        return _content_text(self.messages[-1].get("content")) if self.messages else ""

    @property
    def mean_logprob(self) -> float | None:
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else None


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if content is None else json.dumps(content, ensure_ascii=False)


def _messages(request: Any) -> list[dict[str, Any]]:
    if not isinstance(request, dict):
        return []
    if isinstance(request.get("messages"), list):
        return [m for m in request["messages"] if isinstance(m, dict)]
    prompt = request.get("prompt")
    if isinstance(prompt, list):
        prompt = "\n".join(str(p) for p in prompt)
    return [{"role": "prompt", "content": prompt}] if isinstance(prompt, str) else []


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def is_llm_call(attributes: dict[str, Any]) -> bool:
    return attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL


def describe(attributes: dict[str, Any]) -> LlmCall:
    """An LLM-call span's attributes, readable; missing or malformed parts come out empty."""
    response = _json(attributes.get(semconv.RESPONSE_JSON))
    response = response if isinstance(response, dict) else {}
    text = _content_text(response.get("content")) if "content" in response else str(response.get("text") or "")
    tool_calls = [t for t in response.get("tool_calls") or [] if isinstance(t, dict)]
    prompt_ids = tokens.ids(attributes.get(semconv.PROMPT_TOKEN_IDS) or [])
    response_ids = tokens.ids(attributes.get(semconv.RESPONSE_TOKEN_IDS) or [])
    logprobs = tokens.floats(attributes.get(semconv.RESPONSE_LOGPROBS) or [])
    input_tokens = attributes.get(semconv.GEN_AI_INPUT_TOKENS)
    output_tokens = attributes.get(semconv.GEN_AI_OUTPUT_TOKENS)
    reasons = attributes.get(semconv.GEN_AI_FINISH_REASONS)
    version = attributes.get(semconv.MODEL_VERSION)
    model = attributes.get(semconv.GEN_AI_REQUEST_MODEL)
    return LlmCall(
        messages=_messages(_json(attributes.get(semconv.REQUEST_JSON))),
        response_text=text,
        tool_calls=tool_calls,
        prompt_tokens=input_tokens if isinstance(input_tokens, int) else len(prompt_ids),
        response_tokens=output_tokens if isinstance(output_tokens, int) else len(response_ids),
        logprobs=[float(x) for x in logprobs],
        response_token_ids=[int(x) for x in response_ids],
        model_version=version if isinstance(version, str) else None,
        latency_ms=_number(attributes.get(semconv.LATENCY_MS)),
        finish_reasons=[str(r) for r in reasons] if isinstance(reasons, list | tuple) else [],
        request_model=model if isinstance(model, str) else None,
    )
