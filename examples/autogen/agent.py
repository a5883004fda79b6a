"""An AutoGen AgentChat ``AssistantAgent`` with one tool, ``calculator``, through autogen-ext's
``OpenAIChatCompletionClient`` pointed at the LLM the runner hands the agent.

The model is not an OpenAI one, so the client gets ``model_info`` (what the model can do: function
calling, yes; vision, JSON mode, structured output, no). The agent runs the tool calls it gets and
then asks the model once more to phrase the answer (``reflect_on_tool_use``). A task::

    {"question": "What is 17 * 23?", "answer": 391}

Run it from the repository's root (``pip install autogen-agentchat 'autogen-ext[openai]'``), once::

    fulmen run-once --agent examples.autogen.agent:agent \\
        --task '{"question": "What is 17 * 23?", "answer": 391}'

or under a runner::

    fulmen runner --agent examples.autogen.agent:agent --concurrency 16

The reward is 1.0 when the agent's last message is exactly the answer, else 0.0.
"""

from __future__ import annotations

import logging
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_core.models import ModelFamily, ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient

import fulmen
from examples import multi_turn_tool_agent

MAX_TOOL_ROUNDS = 4
MAX_TOKENS = 256
SYSTEM_PROMPT = "Use the calculator tool for arithmetic, then reply with the final number only."
MODEL_INFO = ModelInfo(
    vision=False, function_calling=True, json_output=False, structured_output=False,
    family=ModelFamily.UNKNOWN, multiple_system_messages=False,
)  # fmt: skip

# AutoGen logs every model call's whole request at INFO; the proxy records each call already.
logging.getLogger("autogen_core.events").setLevel(logging.WARNING)


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. (17 * 23) + 4."""
    return multi_turn_tool_agent.calculator(expression=expression)


def model_client(llm: fulmen.LLM) -> OpenAIChatCompletionClient:
    sampling = {"max_tokens": MAX_TOKENS, **llm.sampling_parameters}
    return OpenAIChatCompletionClient(
        model=llm.model, base_url=llm.base_url, api_key=llm.api_key,
        model_info=MODEL_INFO, **sampling,
    )  # fmt: skip


@fulmen.rollout
async def agent(task: dict[str, Any], llm: fulmen.LLM) -> float:
    """Run the assistant on the question; score its last message."""
    client = model_client(llm)
    try:
        assistant = AssistantAgent(
            "solver", model_client=client, tools=[calculator], system_message=SYSTEM_PROMPT,
            reflect_on_tool_use=True, max_tool_iterations=MAX_TOOL_ROUNDS,
        )  # fmt: skip
        result = await assistant.run(task=task["question"])
    finally:
        await client.close()
    answer = result.messages[-1].content
    fulmen.emit_message(f"answer: {answer}")
    return multi_turn_tool_agent.score(answer if isinstance(answer, str) else str(answer), task["answer"])
