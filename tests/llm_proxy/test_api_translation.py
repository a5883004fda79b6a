"""The Responses and Messages translators alone (no server): whatever a client sends is a `Call` or a
4xx, never an exception that would be a 500; whatever a backend answers reshapes without one; a
failure mid-stream is an event each official client raises."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fulmen_llm_proxy.api.dialects import Dialect
from fulmen_llm_proxy.api.messages import MESSAGES
from fulmen_llm_proxy.api.responses import RESPONSES
from fulmen_llm_proxy.backends.base import Result
from fulmen_llm_proxy.errors import ProxyError

_TEXT = st.text(max_size=12)
_SCALARS = st.none() | st.booleans() | _TEXT | st.floats(allow_nan=False) | st.integers()
_JSON = st.recursive(
    _SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=12
)
# Keys and values each API reads, so the fuzz reaches past the first check.
_KEYS = ["type", "role", "content", "text", "name", "arguments", "call_id", "output", "id", "input", "tool_use_id",
         "parameters", "input_schema", "function", "tool_calls", "index", "delta", "finish_reason"]  # fmt: skip
_WORDS = ["message", "function_call", "function_call_output", "reasoning", "user", "assistant", "system",
          "developer", "input_text", "output_text", "text", "tool_use", "tool_result", "function", "auto", "any",
          "tool", "none", "stop", "length", "tool_calls"]  # fmt: skip
_ITEM = st.recursive(
    st.sampled_from(_WORDS) | _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=5),
    max_leaves=16,
)
_REQUEST = st.dictionaries(
    st.sampled_from(["model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "messages",
                     "system", "max_tokens", "stop_sequences", "temperature", "stream", "include", "text",
                     "thinking", "output_config", "top_p", "parallel_tool_calls"]),
    _ITEM, max_size=6,
)  # fmt: skip
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
DIALECTS = [RESPONSES, MESSAGES]


def _parse(dialect: Dialect, body: Any) -> Any:
    try:
        return dialect.parse(json.dumps(body).encode(), "tiny")
    except ProxyError as e:
        assert 400 <= e.status < 500 and e.message
        json.loads(dialect.error_body(e))
        return None


# Valid requests, which the fuzz overrides a few fields of.
_BASE: dict[str, dict[str, Any]] = {
    RESPONSES.api: {"model": "tiny", "input": [{"role": "user", "content": "hi"}]},
    MESSAGES.api: {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
}


@FUZZ
@given(fields=_REQUEST)
@pytest.mark.parametrize("dialect", DIALECTS, ids=["responses", "messages"])
def test_any_request_is_a_call_or_a_4xx(dialect: Dialect, fields: dict[str, Any]) -> None:
    """A Call whose recorded chat request has messages, or a 4xx in the API's error shape."""
    parsed = _parse(dialect, {**_BASE[dialect.api], **fields})
    if parsed is not None:
        assert parsed.call.operation == "chat" and json.loads(parsed.record)["messages"]


@FUZZ
@given(answer=_ITEM, chunks=st.lists(_ITEM, max_size=4))
@pytest.mark.parametrize("dialect", DIALECTS, ids=["responses", "messages"])
def test_any_answer_reshapes(dialect: Dialect, answer: Any, chunks: list[Any]) -> None:
    """Whatever chat-shaped body or chunks a backend (an upstream) answers: a body and whole events."""
    parsed = _parse(dialect, {**_BASE[dialect.api], "stream": True})
    assert parsed is not None
    json.dumps(dialect.body({"choices": [answer], "usage": answer}, parsed))
    json.dumps(dialect.body(answer if isinstance(answer, dict) else {"x": answer}, parsed))
    encoder = dialect.encoder(parsed)
    events = b"".join(encoder.chunk({"choices": [c]} if not isinstance(c, dict) else c) for c in chunks)
    events += encoder.end(Result())
    assert events.endswith(b"\n\n")
    for event in events.split(b"\n\n")[:-1]:
        kind, data = event.split(b"\n")
        assert json.loads(data[6:])["type"] == kind[7:].decode()


def test_a_failure_mid_stream_is_an_event_the_clients_raise() -> None:
    """Responses: an ``error`` event holding an "error" object (the openai client raises it);
    Messages: Anthropic's ``error`` event and error body (the anthropic client raises it)."""
    failure = ProxyError(503, "engine closed", code="engine_closed")
    parsed = RESPONSES.parse(b'{"model": "tiny", "input": "hi", "stream": true}', None)
    kind, data = RESPONSES.encoder(parsed).error(failure).decode().split("\n")[:2]
    assert kind == "event: error" and json.loads(data[6:])["error"]["message"] == "engine closed"
    parsed = MESSAGES.parse(b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}', None)
    kind, data = MESSAGES.encoder(parsed).error(failure).decode().split("\n")[:2]
    assert kind == "event: error"
    assert json.loads(data[6:]) == {"type": "error", "error": {"type": "overloaded_error", "message": "engine closed"}}
