"""A LangGraph ReAct agent with one tool, ``calculator``, through ``langchain-openai``'s ``ChatOpenAI``.

``ChatOpenAI`` is pointed at the LLM the runner hands the agent (``llm.base_url``: a proxy with this
attempt in the path), so every chat completion the graph makes is recorded against the rollout; the
graph itself is the stock ``create_react_agent``: model → tools → model until the model answers.
A task::

    {"question": "What is 17 * 23?", "answer": 391}

Run it from the repository's root (``pip install langgraph langchain-openai``), once::

    fulmen run-once --agent examples.langgraph.agent:agent \\
        --llm-base-url http://127.0.0.1:8000/v1 --task '{"question": "What is 17 * 23?", "answer": 391}'

or under a runner::

    fulmen runner --agent examples.langgraph.agent:agent --concurrency 16

The reward is 1.0 when the final message is exactly the answer, else 0.0 (also when the graph hits
its step limit).
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

import fulmen
from examples import multi_turn_tool_agent

MAX_TURNS = 6  # model calls per rollout (each tool round is a model step and a tool step)
MAX_TOKENS = 256
SYSTEM_PROMPT = "Use the calculator tool for arithmetic, then reply with the final number only."


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. (17 * 23) + 4."""
    return multi_turn_tool_agent.calculator(expression=expression)


def chat_model(llm: fulmen.LLM) -> ChatOpenAI:
    """ChatOpenAI on the attempt's endpoint, with the run's sampling parameters (greedy when validating)."""
    sampling = {"max_tokens": MAX_TOKENS, **llm.sampling_parameters}
    return ChatOpenAI(
        model=llm.model, base_url=llm.base_url, api_key=llm.api_key, default_headers=llm.headers,
        model_kwargs={k: v for k, v in sampling.items() if k not in ("temperature", "max_tokens")},
        temperature=sampling.get("temperature"), max_tokens=sampling["max_tokens"],
    )  # fmt: skip


@fulmen.rollout
async def agent(task: dict[str, Any], llm: fulmen.LLM) -> float:
    """Run the ReAct graph on the question; score its last message."""
    graph = create_react_agent(chat_model(llm), [calculator], prompt=SYSTEM_PROMPT)
    try:
        state = await graph.ainvoke(
            {"messages": [("user", task["question"])]}, {"recursion_limit": 2 * MAX_TURNS}
        )
    except GraphRecursionError:
        fulmen.emit_message(f"no answer after {MAX_TURNS} model calls")
        return 0.0
    answer = state["messages"][-1].content
    fulmen.emit_message(f"answer: {answer}")
    return multi_turn_tool_agent.score(answer if isinstance(answer, str) else str(answer), task["answer"])
