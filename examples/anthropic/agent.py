"""A tool-use loop with the official ``anthropic`` SDK, on the proxy's Anthropic Messages API.

The agent sends the question with one tool, ``calculator``; while the answer has ``tool_use`` blocks
it runs them and sends their ``tool_result`` back. An answer that is not a bare number gets one more
user turn ("Reply with the final number only.") until the turn limit, so a conversation usually has
several model calls, all recorded against the rollout: the adapter joins them into one trajectory
sample whose mask covers only the model's tokens. A task::

    {"question": "What is 17 * 23?", "answer": 391}

Run it from the repository's root (``pip install anthropic``), once::

    fulmen run-once --agent examples.anthropic.agent:agent \\
        --task '{"question": "What is 17 * 23?", "answer": 391}'

or under a runner, which gives it the proxy with this attempt in the path::

    fulmen runner --agent examples.anthropic.agent:agent --concurrency 16

The client's ``base_url`` is the LLM's without ``/v1`` (the SDK appends ``/v1/messages``); its
``x-api-key`` is the runner's proxy key. Sampling parameters other than ``max_tokens`` travel in
``extra_body``, as recent ``anthropic`` clients want.
"""

from __future__ import annotations

from typing import Any

import anthropic

import fulmen
from examples.multi_turn_tool_agent import calculator, score

MAX_TURNS = 4  # model calls per rollout; no final number by then is reward 0
MAX_TOKENS = 256
SYSTEM_PROMPT = "Use the calculator tool for arithmetic, then reply with the final number only."
NUDGE = "Reply with the final number only."
TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "input_schema": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (17 * 23) + 4"}},
            "required": ["expression"],
        },
    }
]


def run_tool(name: str, arguments: Any) -> str:
    if name != "calculator" or not isinstance(arguments, dict):
        return f"error: unknown tool {name!r} or arguments not an object"
    try:
        return calculator(**arguments)
    except TypeError as e:  # wrong argument names: tell the model
        return f"error: bad arguments ({e})"


def is_number(text: str) -> bool:
    try:
        float(text.strip().replace(",", ""))
    except ValueError:
        return False
    return True


@fulmen.rollout
async def agent(task: dict[str, Any], llm: fulmen.LLM) -> float:
    """Call the model, run its tool calls, ask again for a bare number; score the final answer."""
    sampling = dict(llm.sampling_parameters)
    max_tokens = int(sampling.pop("max_tokens", MAX_TOKENS))
    client = anthropic.AsyncAnthropic(base_url=llm.base_url.removesuffix("/v1"), api_key=llm.api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    async with client:
        for _ in range(MAX_TURNS):
            reply = await client.messages.create(
                model=llm.model, max_tokens=max_tokens, system=SYSTEM_PROMPT, tools=TOOLS,
                messages=messages, extra_body=sampling,
            )  # fmt: skip
            # The assistant's turn goes back as it came, tool_use blocks included.
            messages.append({"role": "assistant", "content": reply.content})
            uses = [block for block in reply.content if block.type == "tool_use"]
            if uses:
                results = [
                    {"type": "tool_result", "tool_use_id": use.id, "content": run_tool(use.name, use.input)}
                    for use in uses
                ]
                messages.append({"role": "user", "content": results})
                continue
            text = "".join(block.text for block in reply.content if block.type == "text")
            if is_number(text):
                fulmen.emit_message(f"answer: {text}")
                return score(text, task["answer"])
            messages.append({"role": "user", "content": NUDGE})
    fulmen.emit_message(f"no number after {MAX_TURNS} model calls")
    return 0.0
