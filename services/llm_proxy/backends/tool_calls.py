"""Tool calls: which tools the template sees and the parser, for backends that generate text (torch),
and the same rules for calls an upstream parsed (vLLM's tool parser: `check_calls`).

Hermes / Qwen2.5 ``<tool_call>`` JSON blocks, parsed all-or-nothing: otherwise the output is plain
content with a ``fulmen_tool_error``. The format and ``tool_choice``: docs/design/proxy.md.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from fulmen_llm_proxy.backends.json_schema import validate
from fulmen_llm_proxy.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's function-name rule (plus dots, which some use)
CALL_ID_HEX = 24


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one request asks of tools: the tools the template renders and what the parser accepts."""

    rendered: list[dict[str, Any]]  # the request's tool objects the chat template sees
    schemas: dict[str, Any]  # name -> parameters schema, for the tools a call may name
    required: str | None = None  # None (auto), "" (any tool) or the one tool's name that must be called
    parallel: bool = True


@dataclass(slots=True)
class Parsed:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # why the output is not tool calls, when it tried or had to be


def plan(body: dict[str, Any]) -> ToolPlan | None:
    """The tool plan of a chat request body; None when no tool is rendered and nothing is parsed.
    A malformed ``tools``, ``tool_choice`` or ``parallel_tool_calls`` is a 400 naming the field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    schemas: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        name, schema = _tool(tool, i)
        if name in schemas:
            raise bad_request(f"tools[{i}]: a second tool named {name!r}", "tools")
        schemas[name] = schema
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice is None or choice == "auto":
        return ToolPlan(list(tools), schemas, None, parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan(list(tools), schemas, "", parallel)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in schemas:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    rendered = [t for t in tools if t["function"]["name"] == name]
    return ToolPlan(rendered, {name: schemas[name]}, name, parallel)


def _tool(tool: Any, i: int) -> tuple[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -", "tools")
    schema = function.get("parameters")
    if schema is not None and not isinstance(schema, dict):
        raise bad_request(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
    return name, schema or {}


def parse(text: str, tools: ToolPlan) -> Parsed:
    """The output ``text`` as content and tool calls (see the module docstring for the rules)."""
    if OPEN not in text:
        return _unmet(text, tools, None)
    calls: list[dict[str, Any]] = []
    outside: list[str] = []
    position = 0
    while True:
        start = text.find(OPEN, position)
        if start < 0:
            outside.append(text[position:])
            break
        outside.append(text[position:start])
        end = text.find(CLOSE, start)
        if end < 0:
            return _plain(text, f"a {OPEN} is never closed by {CLOSE}")
        call, problem = _call(text[start + len(OPEN) : end], tools)
        if problem is not None:
            return _plain(text, problem)
        calls.append(call)
        position = end + len(CLOSE)
    if len(calls) > 1 and not tools.parallel:
        return _plain(text, f"{len(calls)} tool calls, and parallel_tool_calls is false")
    if tools.required and not any(c["function"]["name"] == tools.required for c in calls):
        return _unmet(text, tools, None)
    content = "".join(outside).strip()
    return Parsed(content or None, calls)


def check_calls(calls: list[Any], tools: ToolPlan) -> str | None:
    """Why tool calls an upstream parsed (OpenAI's form) break the rules `parse` applies to text, or
    None: each names a tool offered with arguments its schema accepts, ``parallel_tool_calls`` and
    ``tool_choice`` are kept."""
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return 'a tool call must be {"type": "function", "function": {...}}'
        _, problem = _call(json.dumps({"name": function.get("name"), "arguments": function.get("arguments") or {}}),
                           tools)
        if problem is not None:
            return problem
    if len(calls) > 1 and not tools.parallel:
        return f"{len(calls)} tool calls, and parallel_tool_calls is false"
    if tools.required is not None and not any(not tools.required or c["function"].get("name") == tools.required
                                              for c in calls):
        return _unmet("", tools, None).error
    return None


def as_text(calls: list[dict[str, Any]]) -> str:
    """Tool calls written back as the model writes them (``<tool_call>`` blocks)."""
    blocks = []
    for call in calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        with contextlib.suppress(ValueError):  # else as the upstream sent it
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        blocks.append(OPEN + json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False) + CLOSE)
    return "".join(blocks)


def _call(inner: str, tools: ToolPlan) -> tuple[dict[str, Any], str | None]:
    try:
        obj = json.loads(inner)
    except ValueError as e:
        return {}, f"a tool call is not valid JSON ({e})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return {}, 'a tool call must be a JSON object with a "name"'
    name = obj["name"]
    if name not in tools.schemas:
        return {}, f"a tool call names {name!r}, which is not a tool offered"
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return {}, f"the arguments of {name!r} are a string that is not JSON"
    if not isinstance(arguments, dict):
        return {}, f"the arguments of {name!r} must be a JSON object"
    problem = validate(arguments, tools.schemas[name])
    if problem is not None:
        return {}, f"the arguments of {name!r} do not fit its schema: {problem}"
    return {
        "id": "call_" + uuid.uuid4().hex[:CALL_ID_HEX],
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }, None


def _plain(text: str, error: str) -> Parsed:
    return Parsed(text.strip(), [], error)


def _unmet(text: str, tools: ToolPlan, error: str | None) -> Parsed:
    if tools.required is None:
        return Parsed(text.strip(), [], error)
    wanted = f"a call to {tools.required!r}" if tools.required else "a tool call"
    return _plain(text, f"tool_choice asks for {wanted}; the output holds none")


def safe_prefix(text: str) -> int:
    """How much of ``text`` (as generated so far) may stream as content: up to the first
    ``<tool_call>``, less an ending that could still become one, less trailing whitespace (content is
    stripped when the output ends in calls)."""
    start = text.find(OPEN)
    if start >= 0:
        return len(text[:start].rstrip())
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return len(text[:-n].rstrip())
    return len(text.rstrip())


def stream_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls as one chat-stream delta's ``tool_calls`` (each with its index, whole arguments)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


class ContentGate:
    """While streaming with tools: which content may go out now, so that what was sent is always a
    prefix of the final, stripped content whatever the output turns out to be."""

    __slots__ = ("sent", "start")

    def __init__(self) -> None:
        self.start = -1  # where content starts (leading whitespace is stripped); -1 until known
        self.sent = 0  # end of what went out

    def feed(self, text: str) -> str:
        """The new content to send, given the output so far."""
        if self.start < 0:
            stripped = len(text) - len(text.lstrip())
            if stripped == len(text):
                return ""
            self.start = self.sent = stripped
        ready = safe_prefix(text)
        if ready <= self.sent:
            return ""
        piece, self.sent = text[self.sent : ready], ready
        return piece

    def rest(self, content: str | None) -> str:
        """What of the final ``content`` has not gone out yet."""
        sent = self.sent - max(self.start, 0)
        return (content or "")[sent:]
