"""The OpenAI Responses API (``POST /v1/responses``) as a chat call.

Anything unsupported is a 400 in OpenAI's error shape that names the parameter. What is supported:
docs/design/proxy.md; the response and events: `fulmen_llm_proxy.api.responses_events`.
"""

from __future__ import annotations

from typing import Any

from fulmen_llm_proxy.api.dialects import Encoder, Parsed, record_of
from fulmen_llm_proxy.api.parsing import call_from_body, load_body
from fulmen_llm_proxy.api.responses_events import LOGPROBS_INCLUDE, ResponsesEncoder, response_body
from fulmen_llm_proxy.backends.base import Operation
from fulmen_llm_proxy.errors import ProxyError, bad_request

_IGNORED = frozenset({"store", "metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier",
                      "stream_options", "prompt_cache_retention", "prompt_cache_options"})  # fmt: skip
# Parameters that are fine at their "off" value and refused otherwise.
_OFF: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,), "conversation": (None,), "prompt": (None,), "background": (None, False),
    "reasoning": (None, {}), "top_logprobs": (None, 0), "max_tool_calls": (None,),
    "truncation": (None, "disabled"), "context_management": (None,), "moderation": (None,), "image": (None,),
    "background_options": (None,), "access_programs": (None,),
}  # fmt: skip
_HANDLED = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                      "max_output_tokens", "temperature", "top_p", "stream", "include", "text"})  # fmt: skip
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def unsupported(name: str, why: str = "is not supported by this proxy") -> ProxyError:
    return bad_request(f"{name} {why}", name.split("[")[0].split(".")[0], "unsupported_parameter")


def translate(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Responses request asks for; a 400 for what the proxy cannot serve."""
    for name, value in body.items():
        if name in _HANDLED or name in _IGNORED:
            continue
        if name in _OFF:
            if value not in _OFF[name]:
                raise unsupported(name)
            continue
        raise bad_request(f"Unknown parameter: {name!r}.", name, "unknown_parameter")
    chat: dict[str, Any] = {"messages": messages(body.get("input"), body.get("instructions"))}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        limit = body["max_output_tokens"]
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise bad_request(f"max_output_tokens must be a positive integer, got {limit!r}", "max_output_tokens")
        chat["max_tokens"] = limit
    if body.get("tools"):
        chat["tools"] = tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice(body["tool_choice"])
    _check_text_format(body.get("text"))
    _check_include(body.get("include"))
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # usage for response.completed, from upstreams too
    return chat


def messages(items: Any, instructions: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return out
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}", "input")
            out.append({"role": role, "content": content_text(item.get("content"), where)})
        elif kind == "function_call":
            _add_function_call(out, item, where)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        elif kind != "reasoning":
            raise unsupported(f"{where}.type {kind!r}", "is not supported (message, function_call and "
                              "function_call_output items are)")  # fmt: skip
    return out


def _add_function_call(out: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """Adds a function_call item to the assistant turn it follows, else as a turn of its own."""
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}  # fmt: skip
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)  # one assistant turn: its text, then its calls
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def content_text(content: Any, where: str) -> str:
    """A message's content as one text: a string, or text parts (anything else is a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise unsupported(f"{where}.content[{j}].type {kind!r}", "is not supported (text parts only)")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.content[{j}] has no text", "input")
        texts.append(text)
    return "".join(texts)


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name} must be a string", "input")
    return value


def tools(given: Any) -> list[dict[str, Any]]:
    if not isinstance(given, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(given):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise unsupported(f"tools[{i}].type {kind!r}", "is not supported (function tools only)")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported("tool_choice", "must be auto, none, required or {type: function, name}")


def _check_text_format(text: Any) -> None:
    if text is None:
        return
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and fmt != {"type": "text"}):
        raise unsupported("text.format", "is not supported (plain text output only)")


def _check_include(include: Any) -> None:
    if include is None:
        return
    if not isinstance(include, list) or any(x != LOGPROBS_INCLUDE for x in include):
        raise unsupported("include", f"takes only {LOGPROBS_INCLUDE!r}")


class ResponsesDialect:
    operation: Operation = "chat"
    api = "openai.responses"

    def parse(self, raw: bytes, default_model: str | None) -> Parsed:
        body = load_body(raw)
        chat = translate(body)
        call = call_from_body(chat, "chat", default_model)
        return Parsed(call, record_of(chat), body)

    def body(self, chat: dict[str, Any], parsed: Parsed) -> dict[str, Any]:
        return response_body(chat, parsed.call, parsed.context)

    def encoder(self, parsed: Parsed) -> Encoder:
        return ResponsesEncoder(parsed.call, parsed.context)

    def error_body(self, error: ProxyError) -> bytes:
        return error.body()  # the OpenAI error shape


RESPONSES = ResponsesDialect()
