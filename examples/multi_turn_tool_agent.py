"""A multi-turn agent with a tool: the model asks for a calculator through ``tool_calls``, the agent
runs it and sends the result back, until the model answers; the final answer is scored exactly.

A task is a question and its answer::

    {"question": "A crate holds 17 boxes of 23 apples. How many apples?", "answer": 391}

Each tool call is recorded as a span (``fulmen.operation``), next to the proxy's spans of the model
calls, so the whole conversation is in the rollout's trace. Try it once from the repository's root::

    fulmen run-once --agent examples.multi_turn_tool_agent:agent \\
        --task '{"question": "What is 17 * 23?", "answer": 391}'

and train it under the runner (the model and sampling parameters come from the "llm" resource)::

    fulmen runner --agent examples.multi_turn_tool_agent:agent --concurrency 16
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

import fulmen

MAX_TURNS = 6  # model calls per rollout; an agent that never answers gets reward 0
SYSTEM_PROMPT = (
    "Solve the problem. Use the calculator tool for arithmetic. "
    "When you are done, reply with the final number only."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (17 * 23) + 4"}},
                "required": ["expression"],
            },
        },
    }
]

_OPERATORS: dict[type, Any] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


def _evaluate(node: ast.AST) -> float:
    """Arithmetic only: numbers and the operators above (never Python's eval on model output)."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


@fulmen.operation
def calculator(expression: str) -> str:
    """The tool. Errors go back to the model as text, so it can correct itself."""
    try:
        value = _evaluate(ast.parse(expression, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else str(value)


def run_tool(name: str, arguments: str) -> str:
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        return calculator(**json.loads(arguments))
    except (ValueError, TypeError) as e:  # malformed JSON or wrong arguments: tell the model
        return f"error: bad arguments ({e})"


def score(reply: str | None, answer: float) -> float:
    """1.0 if the reply is exactly the answer (a number, nothing else), else 0.0."""
    try:
        return 1.0 if float((reply or "").strip().replace(",", "")) == float(answer) else 0.0
    except ValueError:
        return 0.0


@fulmen.rollout
async def agent(task: dict[str, Any], llm: fulmen.LLM) -> float:
    """Talk to the model, running its tool calls, until it answers; score the answer."""
    client = llm.async_client  # ready-made for this attempt (ids and trace context ride along)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(
            model=llm.model, messages=messages, tools=TOOLS, **llm.sampling_parameters
        )
        message = response.choices[0].message
        # The assistant's turn goes back verbatim, tool calls included: the model sees what it asked.
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            fulmen.emit_message(f"answer: {message.content}")
            return score(message.content, task["answer"])
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    fulmen.emit_message(f"no answer after {MAX_TURNS} model calls")
    return 0.0
