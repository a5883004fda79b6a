"""The APIs the proxy speaks, each a `Dialect` over the one internal chat / completions call.

`OPENAI_CHAT`, `OPENAI_COMPLETIONS` here; `fulmen_llm_proxy.api.responses` and
`fulmen_llm_proxy.api.messages` for the others. What the app does once for all: docs/design/proxy.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from fulmen_llm_proxy.api.parsing import parse_call
from fulmen_llm_proxy.backends.base import Call, Operation, Result
from fulmen_llm_proxy.errors import ProxyError

_DONE = b"data: [DONE]\n\n"


class Parsed(NamedTuple):
    """A request as the backend serves it."""

    call: Call
    record: bytes  # the chat / completions request JSON the span stores
    context: Any = None  # what the dialect keeps from its own request for the response (echoed fields)


class Encoder(Protocol):
    """Turns one call's chunk bodies into its API's server-sent events."""

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The events for one chat chunk (b"" when it adds none)."""
        ...

    def end(self, result: Result) -> bytes:
        """The closing events, sent once the span is stored."""
        ...

    def error(self, error: ProxyError) -> bytes:
        """The event of a failure after the stream started (its headers are gone)."""
        ...


class Dialect(Protocol):
    operation: Operation
    api: str  # "" for the OpenAI API; else recorded in the span (`fulmen_llm_proxy.recording`)

    def parse(self, raw: bytes, default_model: str | None) -> Parsed: ...

    def body(self, chat: dict[str, Any], parsed: Parsed) -> dict[str, Any]:
        """The non-streaming response from the backend's body (which has ``model_version``)."""
        ...

    def encoder(self, parsed: Parsed) -> Encoder: ...

    def error_body(self, error: ProxyError) -> bytes: ...


class _PassEncoder:
    """OpenAI chunks as they are, then ``[DONE]``."""

    __slots__ = ()

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def end(self, result: Result) -> bytes:
        return _DONE

    def error(self, error: ProxyError) -> bytes:
        # the openai client raises an event holding an "error" key
        return b"data: " + error.body() + b"\n\n"


_PASS = _PassEncoder()


@dataclass(frozen=True, slots=True)
class OpenAIDialect:
    """``/v1/chat/completions`` and ``/v1/completions``: the backends' own shape."""

    operation: Operation
    api: str = ""

    def parse(self, raw: bytes, default_model: str | None) -> Parsed:
        return Parsed(parse_call(raw, self.operation, default_model), raw)

    def body(self, chat: dict[str, Any], parsed: Parsed) -> dict[str, Any]:
        return chat

    def encoder(self, parsed: Parsed) -> Encoder:
        return _PASS

    def error_body(self, error: ProxyError) -> bytes:
        return error.body()


OPENAI_CHAT = OpenAIDialect("chat")
OPENAI_COMPLETIONS = OpenAIDialect("text_completion")


# --- reading the chat output, for the dialects that reshape it ---------------------------------------


def record_of(chat: dict[str, Any]) -> bytes:
    return json.dumps(chat, ensure_ascii=False).encode()


def first_choice(body: dict[str, Any]) -> dict[str, Any]:
    choices = body.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    return choice if isinstance(choice, dict) else {}


def logprob_tokens(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """The choice's per-token log-probabilities (``logprobs.content``), [] when absent."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return [c for c in content if isinstance(c, dict)] if isinstance(content, list) else []


class ToolCalls:
    """Tool calls gathered from a chat message or from streamed deltas (keyed by their index)."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, str]] = {}

    def add_message(self, calls: Any) -> None:
        for i, call in enumerate(calls if isinstance(calls, list) else ()):
            self.add_delta({**call, "index": i} if isinstance(call, dict) else {})

    def add_delta(self, delta: dict[str, Any]) -> None:
        index = delta.get("index", len(self._calls))
        call = self._calls.setdefault(index if isinstance(index, int) else 0, {"id": "", "name": "", "arguments": ""})
        function = delta.get("function") if isinstance(delta.get("function"), dict) else {}
        call["id"] = str(delta.get("id") or call["id"])
        call["name"] += str(function.get("name") or "")
        call["arguments"] += str(function.get("arguments") or "")

    def all(self) -> list[dict[str, str]]:
        """Each call's id, name and arguments (a JSON text), in index order."""
        return [self._calls[i] for i in sorted(self._calls)]


def usage_of(body: dict[str, Any], result: Result | None) -> tuple[int, int]:
    """(input, output) tokens: the result's, else the body's ``usage``, else 0."""
    if result is not None and result.input_tokens is not None and result.output_tokens is not None:
        return result.input_tokens, result.output_tokens
    usage = body.get("usage")
    if isinstance(usage, dict):
        n_in, n_out = usage.get("prompt_tokens"), usage.get("completion_tokens")
        return (n_in if isinstance(n_in, int) else 0), (n_out if isinstance(n_out, int) else 0)
    return 0, 0


class StreamedChat:
    """What a streaming call's chat chunks have said so far, read the same way for every API the
    proxy translates (`fulmen_llm_proxy.api.messages_events`, `fulmen_llm_proxy.api.responses_events`)."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.calls = ToolCalls()
        self.prompt_ids: list[int] | None = None
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self.version = ""

    def read(self, chunk: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """Take a chunk in; its first choice and the text it adds ("" when none)."""
        self.version = str(chunk.get("model_version") or self.version)
        if isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_ids = chunk["prompt_token_ids"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choice = first_choice(chunk)
        if isinstance(choice.get("token_ids"), list):
            self.token_ids.extend(choice["token_ids"])
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        for tool_delta in delta.get("tool_calls") or ():
            if isinstance(tool_delta, dict):
                self.calls.add_delta(tool_delta)
        text = delta.get("content")
        if not isinstance(text, str) or not text:
            return choice, ""
        self.texts.append(text)
        return choice, text

