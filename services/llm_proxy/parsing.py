"""Turn a request body into a validated `Call`, or a 400 that names the bad parameter."""

from __future__ import annotations

import json
from typing import Any

from fulmen_llm_proxy.backend_base import Call, Operation
from fulmen_llm_proxy.errors import ProxyError, bad_request


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad_request(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"{name} must be a positive integer, got {value!r}", name)
    return value


def parse_call(raw: bytes, operation: Operation, default_model: str | None) -> Call:
    """Validate the fields the proxy reads; the rest of the body is left for the backend."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProxyError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model") or default_model
    if not isinstance(model, str) or not model:
        raise bad_request("model is required", "model")
    if operation == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("messages must be a non-empty list of message objects", "messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise bad_request("tools must be a list", "tools")
    else:
        check_prompt(body.get("prompt"))
    n = body.get("n")
    if n not in (None, 1):
        raise bad_request("only n=1 is supported (run n rollouts instead)", "n")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a string or a list of strings", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request(f"seed must be an integer, got {seed!r}", "seed")
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
    )


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
