"""A chat call as an Anthropic Messages request, and the upstream's answer back as a chat body or chunks.

The reverse of `fulmen_llm_proxy.api.messages`, for `fulmen_llm_proxy.backends.upstream.anthropic`. A block
type it does not know is a 502 that names it, never a silent loss. The field mapping: docs/design/proxy.md.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fulmen_llm_proxy.backends.base import Call
from fulmen_llm_proxy.errors import ProxyError, bad_request

ANTHROPIC_VERSION = "2023-06-01"
_SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})  # reasoning the chat shape has no place for
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
           "refusal": "content_filter", "pause_turn": "stop", "model_context_window_exceeded": "length"}  # fmt: skip
# chat fields that would change the answer and that Anthropic cannot honour: (field, when it matters)
_REFUSED = (
    ("logprobs", lambda v: bool(v)), ("top_logprobs", lambda v: v is not None),
    ("logit_bias", lambda v: bool(v)), ("presence_penalty", lambda v: bool(v)),
    ("frequency_penalty", lambda v: bool(v)), ("audio", lambda v: v is not None),
    ("prediction", lambda v: v is not None),
    ("response_format", lambda v: not (isinstance(v, dict) and v.get("type") == "text")),
)  # fmt: skip


def unsupported(name: str, why: str) -> ProxyError:
    return bad_request(f"{name}: {why} on the anthropic backend", name.split("[")[0].split(".")[0],
                       "unsupported_parameter")  # fmt: skip


# --- request ---------------------------------------------------------------------------------------


def messages_request(call: Call, default_max_tokens: int) -> dict[str, Any]:
    """The ``POST /v1/messages`` body for a chat call; a 400 for what Anthropic cannot do."""
    _check(call)
    body = call.body
    temperature = body.get("temperature")
    system, turns = _turns(call.messages)
    out: dict[str, Any] = {"model": call.model, "max_tokens": call.max_tokens or default_max_tokens}
    if system:
        out["system"] = system
    out["messages"] = turns
    if temperature is not None:
        out["temperature"] = temperature
    if body.get("top_p") is not None:
        out["top_p"] = body["top_p"]
    if call.stop:
        out["stop_sequences"] = call.stop
    if call.tools:
        out["tools"] = [_tool(tool, i) for i, tool in enumerate(call.tools)]
        choice = _tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls"))
        if choice is not None:
            out["tool_choice"] = choice
    if isinstance(body.get("user"), str) and body["user"]:
        out["metadata"] = {"user_id": body["user"]}
    if call.stream:
        out["stream"] = True
    return out


def _check(call: Call) -> None:
    """A 400 for what Anthropic cannot honour: several choices, a refused field, a temperature above 1."""
    body = call.body
    if call.n > 1:
        raise unsupported("n", "Anthropic returns one choice per call; send n calls")
    for name, matters in _REFUSED:
        if body.get(name) is not None and matters(body[name]):
            raise unsupported(name, "not supported")
    temperature = body.get("temperature")
    if temperature is not None and call.temperature > 1:
        raise bad_request(f"temperature: Anthropic takes [0, 1], got {temperature!r}", "temperature")


def _turns(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """(the system prompt, the user/assistant turns with consecutive same-role turns merged)."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role in ("system", "developer"):
            system.append(_text_of(message.get("content"), where))
            continue
        if role == "user":
            role, blocks = "user", _user_blocks(message.get("content"), where)
        elif role == "assistant":
            blocks = _assistant_blocks(message, where)
        elif role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise bad_request(f"{where}.tool_call_id: must be a string", "messages")
            result = {"type": "tool_result", "tool_use_id": message["tool_call_id"],
                      "content": _text_of(message.get("content"), where)}  # fmt: skip
            role, blocks = "user", [result]
        else:
            raise unsupported(f"{where}.role {role!r}", "only system, developer, user, assistant and tool roles are")
        if not blocks:
            continue  # an empty assistant turn: Anthropic refuses empty content
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    for turn in turns:
        content = turn["content"]
        if len(content) == 1 and content[0]["type"] == "text":
            turn["content"] = content[0]["text"]
    return "\n\n".join(system), turns


def _text_of(content: Any, where: str) -> str:
    """A string, or text parts joined (system and tool messages)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or a list of text parts", "messages")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise unsupported(f"{where}.content[{j}]", "only text parts are supported here")
        texts.append(part["text"])
    return "".join(texts)


def _user_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or a list of content parts", "messages")
    blocks = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            blocks.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and isinstance(part.get("image_url"), dict | str):
            blocks.append({"type": "image", "source": _image_source(part["image_url"], f"{where}.content[{j}]")})
        else:
            raise unsupported(f"{where}.content[{j}].type {kind!r}", "user content takes text and image_url parts")
    return blocks


def _image_source(image: dict[str, Any] | str, where: str) -> dict[str, Any]:
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        raise bad_request(f"{where}.image_url.url: must be a string", "messages")
    if url.startswith("data:"):
        head, _, data = url[5:].partition(",")
        media_type, _, encoding = head.partition(";")
        if encoding != "base64" or not data:
            raise bad_request(f"{where}.image_url.url: a data URL must be base64", "messages")
        return {"type": "base64", "media_type": media_type, "data": data}
    return {"type": "url", "url": url}


def _assistant_blocks(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    content = message.get("content")
    if isinstance(content, list):  # text and refusal parts
        content = "".join(p.get("text") or p.get("refusal") or "" for p in content if isinstance(p, dict))
    if isinstance(content, str) and content:
        blocks.append({"type": "text", "text": content})
    for k, tool_call in enumerate(message.get("tool_calls") or ()):
        function = tool_call.get("function") if isinstance(tool_call, dict) else None
        at = f"{where}.tool_calls[{k}]"
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{at}: a function call with a name is required", "messages")
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            arguments = None
        if not isinstance(arguments, dict):
            raise bad_request(f"{at}.function.arguments: Anthropic takes a JSON object as a tool's input", "messages")
        blocks.append({"type": "tool_use", "id": str(tool_call.get("id") or f"toolu_{k}"),
                       "name": function["name"], "input": arguments})  # fmt: skip
    return blocks


def _tool(tool: Any, i: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise unsupported(f"tools[{i}]", "only function tools with a name are supported")
    out: dict[str, Any] = {"name": function["name"]}
    if function.get("description") is not None:
        out["description"] = function["description"]
    out["input_schema"] = function.get("parameters") or {"type": "object", "properties": {}}
    return out


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    if choice is None:
        out: dict[str, Any] | None = {"type": "auto"} if parallel is False else None
    elif choice in ("auto", "none"):
        out = {"type": choice}
    elif choice == "required":
        out = {"type": "any"}
    elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        out = {"type": "tool", "name": choice["function"]["name"]}
    else:
        raise unsupported("tool_choice", "must be auto, none, required or {type: function, function: {name}}")
    if out is not None and parallel is False and out["type"] != "none":
        out["disable_parallel_tool_use"] = True
    return out


# --- answer ----------------------------------------------------------------------------------------


def finish_reason(stop_reason: Any) -> str | None:
    return _FINISH.get(stop_reason, "stop") if stop_reason is not None else None


def chat_usage(usage: Any) -> dict[str, int] | None:
    if not isinstance(usage, dict):
        return None
    n_in = sum(v for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
               if isinstance(v := usage.get(k), int))  # fmt: skip
    n_out = usage.get("output_tokens") if isinstance(usage.get("output_tokens"), int) else 0
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def unknown_block(kind: Any) -> ProxyError:
    return ProxyError(
        502, f"the Anthropic upstream answered a content block of type {kind!r}, which the anthropic "
        "backend cannot translate into a chat answer", code="upstream_unsupported",
    )  # fmt: skip


def tool_call(block: dict[str, Any]) -> dict[str, Any]:
    return {"id": str(block.get("id") or ""), "type": "function",
            "function": {"name": str(block.get("name") or ""),
                         "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}}  # fmt: skip


def chat_body(message: Any, model: str) -> dict[str, Any]:
    """A chat completion body from a Messages answer."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        raise ProxyError(502, "the Anthropic upstream answered without a content list", code="upstream_error")
    texts, calls = [], []
    for block in message["content"]:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text") or ""))
        elif kind == "tool_use":
            calls.append(tool_call(block))
        elif kind not in _SKIPPED_BLOCKS:
            raise unknown_block(kind)
    text = "".join(texts)
    chat_message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        chat_message["tool_calls"] = calls
    body: dict[str, Any] = {
        "id": str(message.get("id") or ""), "object": "chat.completion", "created": int(time.time()),
        "model": str(message.get("model") or model),
        "choices": [{"index": 0, "message": chat_message, "logprobs": None,
                     "finish_reason": finish_reason(message.get("stop_reason")) or "stop"}],
    }  # fmt: skip
    usage = chat_usage(message.get("usage"))
    if usage is not None:
        body["usage"] = usage
    return body
