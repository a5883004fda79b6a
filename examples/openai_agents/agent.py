"""The OpenAI Agents SDK: one agent with one function tool, ``calculator``, on the Fulmen proxy.

Two entry points, one per model class of the SDK, both on an ``AsyncOpenAI`` client at ``llm.base_url``
(the proxy, with this attempt in the path):

- ``agent``: ``OpenAIResponsesModel``, the SDK's default, on the proxy's ``/v1/responses``;
- ``chat_agent``: ``OpenAIChatCompletionsModel``, on ``/v1/chat/completions``.

The SDK's tracing export (to OpenAI's servers) is switched off: Fulmen records the calls itself.
A task::

    {"question": "What is 17 * 23?", "answer": 391}

Run it from the repository's root (``pip install openai-agents``), once::

    fulmen run-once --agent examples.openai_agents.agent:agent \\
        --task '{"question": "What is 17 * 23?", "answer": 391}'

or under a runner (``examples.openai_agents.agent:chat_agent`` for the chat-completions model)::

    fulmen runner --agent examples.openai_agents.agent:agent --concurrency 16

The reward is 1.0 when the final output is exactly the answer, else 0.0 (also past the turn limit).
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    Model,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

import fulmen
from examples import multi_turn_tool_agent

MAX_TURNS = 6
MAX_TOKENS = 256
SYSTEM_PROMPT = "Use the calculator tool for arithmetic, then reply with the final number only."

set_tracing_disabled(True)  # no export to OpenAI's trace endpoint (there is no OpenAI key here)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: e.g. (17 * 23) + 4
    """
    return multi_turn_tool_agent.calculator(expression=expression)


def model_settings(llm: fulmen.LLM) -> ModelSettings:
    sampling = {"max_tokens": MAX_TOKENS, **llm.sampling_parameters}
    return ModelSettings(
        temperature=sampling.pop("temperature", None), top_p=sampling.pop("top_p", None),
        max_tokens=sampling.pop("max_tokens"), extra_body=sampling or None,
    )  # fmt: skip


async def solve(task: dict[str, Any], llm: fulmen.LLM, model: Model) -> float:
    solver = Agent(
        name="solver", instructions=SYSTEM_PROMPT, tools=[calculator], model=model,
        model_settings=model_settings(llm),
    )  # fmt: skip
    try:
        result = await Runner.run(
            solver, task["question"], max_turns=MAX_TURNS, run_config=RunConfig(tracing_disabled=True)
        )
    except MaxTurnsExceeded:
        fulmen.emit_message(f"no answer after {MAX_TURNS} turns")
        return 0.0
    except ModelBehaviorError as e:  # e.g. an answer cut at max_tokens (the Responses API's "incomplete")
        fulmen.emit_message(f"no usable answer: {e}")
        return 0.0
    fulmen.emit_message(f"answer: {result.final_output}")
    return multi_turn_tool_agent.score(str(result.final_output), task["answer"])


@fulmen.rollout
async def agent(task: dict[str, Any], llm: fulmen.LLM) -> float:
    """The Responses API model (the SDK's default)."""
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    return await solve(task, llm, OpenAIResponsesModel(model=llm.model, openai_client=client))


@fulmen.rollout
async def chat_agent(task: dict[str, Any], llm: fulmen.LLM) -> float:
    """The chat-completions model."""
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    return await solve(task, llm, OpenAIChatCompletionsModel(model=llm.model, openai_client=client))
