"""The Anthropic Messages API (``POST /v1/messages``) as a chat call.

Anything unsupported is a 400 in Anthropic's error shape. What is supported: docs/design/proxy.md;
the response and events: `fulmen_llm_proxy.api.messages_events`.
"""

from __future__ import annotations

import json
from typing import Any

from fulmen_llm_proxy.api.dialects import Encoder, Parsed, record_of
from fulmen_llm_proxy.api.messages_events import MessagesEncoder, message_body
from fulmen_llm_proxy.api.parsing import call_from_body, load_body
from fulmen_llm_proxy.backends.base import Operation
from fulmen_llm_proxy.errors import ProxyError, bad_request

_HANDLED = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
                      "stream", "tools", "tool_choice", "thinking", "output_config"})  # fmt: skip
_IGNORED = frozenset({"metadata", "service_tier", "cache_control", "inference_geo", "speed", "user_profile_id",
                      "workspace_id", "diagnostics"})  # fmt: skip
# Anthropic's error type for each status the proxy answers with
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


def unsupported(name: str, why: str = "is not supported by this proxy") -> ProxyError:
    return bad_request(f"{name}: {why}", name.split("[")[0].split(".")[0], "unsupported_parameter")


def translate(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Messages request asks for; a 400 for what the proxy cannot serve."""
    limit = _check(body)
    chat: dict[str, Any] = {"messages": messages(body.get("system"), body.get("messages")), "max_tokens": limit}
    for name in ("model", "temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("tools"):
        chat["tools"] = tools(body["tools"])
    if body.get("tool_choice") is not None:
        tool_choice(body["tool_choice"], chat)
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # usage for message_delta, from upstreams too
    return chat


def _check(body: dict[str, Any]) -> int:
    """A 400 for a field the proxy cannot serve or a value out of range; else the request's max_tokens."""
    for name in body:
        if name not in _HANDLED and name not in _IGNORED:
            raise unsupported(name)
    config = body.get("output_config")
    if config is not None and (not isinstance(config, dict) or set(config) - {"effort"}):
        raise unsupported("output_config", "only effort is accepted (it has no effect here)")
    thinking = body.get("thinking")
    if thinking is not None and thinking != {"type": "disabled"}:
        raise unsupported("thinking", "extended thinking is not supported")
    limit = body.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise bad_request(f"max_tokens: a positive integer is required, got {limit!r}", "max_tokens")
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature <= 1
    ):
        raise bad_request(f"temperature: must be in [0, 1], got {temperature!r}", "temperature")
    return limit


def messages(system: Any, given: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system is not None:
        text = system if isinstance(system, str) else _texts(system, "system")
        out.append({"role": "system", "content": text})
    if not isinstance(given, list) or not given:
        raise bad_request("messages: a non-empty list of messages is required", "messages")
    for i, message in enumerate(given):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role: must be user or assistant", "messages")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out.extend(_assistant(content, where) if role == "assistant" else _user(content, where))
        else:
            raise bad_request(f"{where}.content: must be a string or a list of content blocks", "messages")
    if given[-1]["role"] == "assistant":
        # Anthropic continues a final assistant message; a chat template would close it and start a
        # new turn instead, so the answer would not be what the agent asked for.
        raise unsupported("messages", "a final assistant message (prefill) is not supported; end with a user turn")
    return out


def _block_kind(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise bad_request(f"{where}: a content block must be an object with a type", "messages")
    return kind


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text: must be a string", "messages")
    return text


def _texts(blocks: Any, where: str) -> str:
    """Text blocks (the system prompt, a tool result) as one text."""
    if not isinstance(blocks, list):
        raise bad_request(f"{where}: must be a string or a list of text blocks", where.split("[")[0])
    texts = []
    for j, block in enumerate(blocks):
        if _block_kind(block, f"{where}[{j}]") != "text":
            raise unsupported(f"{where}[{j}].type {block['type']!r}", "only text blocks are supported here")
        texts.append(_text(block, f"{where}[{j}]"))
    return "".join(texts)


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", _block_kind(block, f"{where}.content[{j}]")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{at}: tool_use needs a string id and name", "messages")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": arguments}})  # fmt: skip
        elif kind not in ("thinking", "redacted_thinking"):
            raise unsupported(f"{at}.type {kind!r}", "assistant content takes text and tool_use blocks")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Tool results first (a chat template wants them right after the assistant's calls), then text."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", _block_kind(block, f"{where}.content[{j}]")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{at}.tool_use_id: must be a string", "messages")
            content = block.get("content", "")
            text = content if isinstance(content, str) else _texts(content, f"{at}.content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise unsupported(f"{at}.type {kind!r}", "user content takes text and tool_result blocks")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def tools(given: Any) -> list[dict[str, Any]]:
    if not isinstance(given, list):
        raise bad_request("tools: must be a list", "tools")
    out = []
    for i, tool in enumerate(given):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise unsupported(f"tools[{i}].type {kind!r}", "only custom tools (name, input_schema) are supported")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name: must be a non-empty string", "tools")
        function: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise unsupported("tool_choice", "must be {type: auto | any | none} or {type: tool, name}")
    if choice.get("disable_parallel_tool_use") and kind != "none":
        chat["parallel_tool_calls"] = False


def error_body(error: ProxyError) -> bytes:
    kind = _ERROR_TYPES.get(error.status, "api_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": error.message}}).encode()


class MessagesDialect:
    operation: Operation = "chat"
    api = "anthropic.messages"

    def parse(self, raw: bytes, default_model: str | None) -> Parsed:
        body = load_body(raw)
        chat = translate(body)
        try:
            call = call_from_body(chat, "chat", default_model)
        except ProxyError as e:
            if e.param == "stop":  # the chat name of what this API calls stop_sequences
                e.param, e.message = "stop_sequences", e.message.replace("stop", "stop_sequences", 1)
            raise
        return Parsed(call, record_of(chat), body)

    def body(self, chat: dict[str, Any], parsed: Parsed) -> dict[str, Any]:
        return message_body(chat, parsed.call)

    def encoder(self, parsed: Parsed) -> Encoder:
        return MessagesEncoder(parsed.call, error_body)

    def error_body(self, error: ProxyError) -> bytes:
        return error_body(error)


MESSAGES = MessagesDialect()
