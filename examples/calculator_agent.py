"""The tool-use demo's agent: a multi-turn loop that answers three-digit multiplication by calling a
`calculator` tool, then answering (`fulmen.demo.calculator`; Procfile.tools trains it).

    fulmen run-once --agent examples.calculator_agent:agent --task '{"question": "123*456=", "answer": "56088", "a": 123, "b": 456, "op": "*"}'
    honcho -f Procfile.tools -e .env.tools start

Each turn is one chat call with the tool offered; the proxy parses the model's
``<tool_call>{json}</tool_call>`` into ``tool_calls``, the agent runs them and sends the results back,
until the model answers in text (or MAX_TURNS). The reward is checked on that answer. The whole
conversation is one trajectory sample for the trainer (FULMEN_SAMPLE_SHAPE=trajectory).
"""

from __future__ import annotations

from typing import Any

import fulmen
from fulmen.demo import calculator

MAX_TURNS = 3  # a call, the answer, and one spare call
CALL_TOKENS = 12  # the demo model writes a call in 10 tokens (fulmen_algorithm.demos.tools); 96 for char-level
ANSWER_TOKENS = 8  # six digits and the end of the turn


@fulmen.rollout
async def agent(task: dict[str, Any], llm: fulmen.LLM) -> float:
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    params = dict(llm.sampling_parameters)
    params.pop("max_tokens", None)
    for turn in range(MAX_TURNS):
        reply = await llm.async_client.chat.completions.create(
            model=llm.model, messages=messages, tools=[calculator.CALCULATOR],  # type: ignore[list-item]
            max_tokens=ANSWER_TOKENS if turn > 0 else CALL_TOKENS, **params,
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            return calculator.reward(task, message.content)
        calls = [call.model_dump() for call in message.tool_calls]
        messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
        messages += [{"role": "tool", "tool_call_id": call["id"], "content": calculator.run_tool_call(call)}
                     for call in calls]
    return 0.0
