"""A LangGraph ReAct agent with one tool, ``calculator``, through ``langchain-openai``'s ``ChatOpenAI``.

``ChatOpenAI`` is pointed at the LLM the runner hands the agent (``llm.base_url``: a proxy with this
attempt in the path), so every chat completion the graph makes is recorded against the rollout. The
graph is the ReAct loop written with LangGraph's own pieces (``StateGraph``, ``ToolNode``,
``tools_condition``): model → tools → model, until the model answers without a tool call.
A task::

    {"question": "What is 17 * 23?", "answer": 391}

Run it from the repository's root (``pip install langgraph langchain-openai``), once::

    fulmen run-once --agent examples.langgraph.agent:agent \\
        --task '{"question": "What is 17 * 23?", "answer": 391}'

or under a runner::

    fulmen runner --agent examples.langgraph.agent:agent --concurrency 16

The reward is 1.0 when the final message is exactly the answer, else 0.0 (also when the graph hits
its step limit).
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition

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
        model=llm.model, base_url=llm.base_url, api_key=llm.api_key,
        model_kwargs={k: v for k, v in sampling.items() if k not in ("temperature", "max_tokens")},
        temperature=sampling.get("temperature"), max_tokens=sampling["max_tokens"],
    )  # fmt: skip


def react_graph(model: ChatOpenAI) -> CompiledStateGraph:
    """model → (tool calls? tools → model) … → end."""
    bound = model.bind_tools([calculator])

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await bound.ainvoke([SystemMessage(SYSTEM_PROMPT), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)  # to "tools" or to the end
    graph.add_edge("tools", "model")
    return graph.compile()


@fulmen.rollout
async def agent(task: dict[str, Any], llm: fulmen.LLM) -> float:
    """Run the ReAct graph on the question; score its last message."""
    graph = react_graph(chat_model(llm))
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
