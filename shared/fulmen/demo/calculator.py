"""The tool-use demo's task: three-digit multiplication that an agent answers by calling a calculator.

`CALCULATOR`, `calculate` and `demonstrations` (for the SFT warm start); the reward is
`fulmen.demo.arithmetic.reward`. Why it is shaped this way: docs/design/demo.md.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fulmen.demo import arithmetic

__all__ = ["CALCULATOR", "TOOL_NAME", "calculate", "demonstrations", "expression_of", "make_tasks", "reward", "run_tool_call"]

TOOL_NAME = "calculator"
# Kept short: the chat template renders the schema into every prompt, one character a token.
CALCULATOR: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "a*b",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
DIGITS, OPS = 3, "*"
_EXPRESSION = re.compile(r"\s*(-?\d{1,12})\s*([-+*])\s*(-?\d{1,12})\s*")


def calculate(expression: Any) -> str:
    """``a op b`` (integers, op one of ``+ - *``) computed exactly, or a short error text: the tool
    never raises, whatever the model wrote (a wrong call is the model's mistake, not a crash)."""
    match = _EXPRESSION.fullmatch(expression) if isinstance(expression, str) else None
    if match is None:
        return "error"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def run_tool_call(call: dict[str, Any]) -> str:
    """The result of one OpenAI ``tool_calls`` entry (arguments a JSON string, as the proxy sends)."""
    function = call.get("function") or {}
    if function.get("name") != TOOL_NAME:
        return "error"
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        return "error"
    return calculate(arguments.get("expression")) if isinstance(arguments, dict) else "error"


def make_tasks(split: str, n: int, *, seed: int = 0) -> list[arithmetic.Task]:
    """``n`` three-digit multiplication tasks of ``split`` (see `fulmen.demo.arithmetic.make_tasks`)."""
    return arithmetic.make_tasks(split, n, seed=seed, digits=DIGITS, ops=OPS)


def reward(task: arithmetic.Task, answer: str | None) -> float:
    """1.0 when the final answer starts with exactly the product (`fulmen.demo.arithmetic.reward`)."""
    return arithmetic.reward(task, answer)


def expression_of(task: arithmetic.Task) -> str:
    return f"{task['a']}{task['op']}{task['b']}"


def demonstrations(tasks: list[arithmetic.Task]) -> list[dict[str, Any]]:
    """One correct tool-using conversation per task: ``{"id", "messages", "tools"}``, the last
    assistant message the answer. The call's arguments are written as the proxy writes them back
    (``json.dumps``), so a re-rendered conversation matches what the model generated."""
    demos = []
    for task in tasks:
        expression = expression_of(task)
        call = {"id": "call_0", "type": "function",
                "function": {"name": TOOL_NAME, "arguments": json.dumps({"expression": expression})}}
        demos.append({
            "id": f"demo-{task['id']}",
            "tools": [CALCULATOR],
            "messages": [
                {"role": "user", "content": task["question"]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": calculate(expression)},
                {"role": "assistant", "content": str(task["answer"])},
            ],
        })
    return demos
