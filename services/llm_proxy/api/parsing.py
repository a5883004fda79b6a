"""Turn a request body into a validated `Call`, or a 400 that names the bad parameter.

Whatever would later fail or cost the event loop out of proportion is refused here, before any work.
What and why: docs/design/proxy.md.
"""

from __future__ import annotations

import re
from typing import Any

from fulmen_llm_proxy.api import json_body
from fulmen_llm_proxy.backends.base import Call, Operation
from fulmen_llm_proxy.errors import ProxyError, bad_request


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad_request(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


# Nesting a real request needs (messages, tool schemas) stays far below this; json's own limit
# (~1,000) would leave later json.dumps calls, deeper in the stack, to fail instead.
MAX_JSON_DEPTH = 64
MAX_STOP_STRINGS = 16  # OpenAI accepts 4; each one is checked against the text after every token
MAX_STOP_CHARS = 256
MAX_N = 16  # choices per call: each one is a request in the engine's batch
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what the span's msgpack encoding holds


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT64_MAX:
        raise bad_request(f"{name} must be an integer in [1, {INT64_MAX}], got {_short(value)}", name)
    return value


def _short(value: Any) -> str:
    """A value for an error message: a 5,000-digit integer or a 1 MB string is not echoed whole."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a larger integer"
    return text if len(text) <= 80 else text[:77] + "..."


def check_shape(body: Any) -> None:
    """Refuse nesting deeper than `MAX_JSON_DEPTH` and strings (values or keys) that are not valid
    Unicode (a lone surrogate from a ``\\udXXX`` escape). One pass, no recursion."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ProxyError(400, f"request JSON is nested deeper than {MAX_JSON_DEPTH}", code="invalid_json")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key)
                if isinstance(item, dict | list):
                    stack.append((item, depth + 1))
                elif isinstance(item, str):
                    _check_text(item)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict | list):
                    stack.append((item, depth + 1))
                elif isinstance(item, str):
                    _check_text(item)


def _check_text(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ProxyError(
                400, "request JSON holds a lone surrogate (\\ud800-\\udfff), which is not text",
                code="invalid_json",
            ) from None  # fmt: skip


def parse_call(raw: bytes, operation: Operation, default_model: str | None) -> Call:
    """Validate the fields the proxy reads; the rest of the body is left for the backend."""
    return call_from_body(load_body(raw), operation, default_model)


def load_body(raw: bytes) -> dict[str, Any]:
    """The request JSON object, checked by `check_shape`; a 400 when it is not one."""
    try:
        body = json_body.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProxyError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ProxyError(
            400, f"request JSON is nested deeper than {MAX_JSON_DEPTH}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if not _plainly_shaped(raw):
        check_shape(body)
    return body


# What a lone surrogate can come from in a UTF-8 body: a \\uD800-\\uDFFF escape, or its UTF-8 bytes
# (json decodes bytes with "surrogatepass"). A match is only a reason to look (`check_shape`).
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _plainly_shaped(raw: bytes) -> bool:
    """True when the raw UTF-8 body cannot break `check_shape`'s rules: too few brackets to nest
    deeper than `MAX_JSON_DEPTH`, nothing that decodes to a lone surrogate. Scanned in C, where the
    walk over a usual body costs more than parsing it."""
    return (raw[:1] == b"{" and raw[1:2] != b"\x00"  # UTF-8, as json.detect_encoding would say
            and raw.count(b"{") + raw.count(b"[") <= MAX_JSON_DEPTH and _MAYBE_SURROGATE.search(raw) is None)


def call_from_body(body: dict[str, Any], operation: Operation, default_model: str | None) -> Call:
    """The `Call` of a loaded chat or completions body (the other APIs translate into one first)."""
    # Absent: the proxy's default model. Present but empty or not a string: the client's mistake,
    # never silently replaced by the default.
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise bad_request(f"model must be a non-empty string, got {_short(model)}", "model")
    if operation == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("messages must be a non-empty list of message objects", "messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise bad_request("tools must be a list", "tools")
    else:
        check_prompt(body.get("prompt"))
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise bad_request(f"n must be an integer in [1, {MAX_N}], got {_short(n)}", "n")
    stop = _stop_strings(body.get("stop"))
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not INT64_MIN <= seed <= INT64_MAX
    ):
        raise bad_request(f"seed must be a 64-bit integer, got {_short(seed)}", "seed")
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    return Call(
        operation=operation,
        body=body,
        model=model,
        stream=bool(stream),
        max_tokens=_positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens"),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed,
        stop=stop,
        tokens_as_ids=bool(body.get("return_tokens_as_token_ids")),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        n=n,
    )


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad_request(
            f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters", "stop"
        )
    return stop


def check_prompt(prompt: Any) -> None:
    """A ``/v1/completions`` prompt: one string or one list of token ids (or a one-element list of
    either)."""
    prompt = single_prompt(prompt)
    if isinstance(prompt, str):
        return
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return
    raise bad_request("prompt must be a string or a list of token ids (one prompt per request)", "prompt")


def single_prompt(prompt: Any) -> str | list[int]:
    """The one prompt of a validated ``/v1/completions`` body."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt
