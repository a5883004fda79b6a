"""A single-turn agent: one chat completion with the official ``openai`` SDK, rewarded by an exact check.

A task is an arithmetic question and its answer::

    {"question": "What is 17 * 23?", "answer": 391}

The reward is 1.0 when the last number in the model's reply equals the answer, else 0.0.

Try it once from the repository's root (so that ``examples`` imports); with nothing running, run-once
starts the embedded Redis and serves the tiny model itself (``--model-dir DIR`` for yours)::

    fulmen run-once --agent examples.single_turn_agent:agent \\
        --task '{"question": "What is 17 * 23?", "answer": 391}'

Then train it end to end on a file of tasks::

    fulmen train --agent examples.single_turn_agent:agent --tasks examples/tasks.jsonl
"""

from __future__ import annotations

import re
from typing import Any

import openai

import fulmen

SYSTEM_PROMPT = "You are a careful calculator. Answer with the final number only."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(reply: str | None, answer: float) -> float:
    """1.0 if the last number in ``reply`` equals ``answer`` exactly, else 0.0."""
    numbers = NUMBER.findall((reply or "").replace(",", ""))
    return 1.0 if numbers and float(numbers[-1]) == float(answer) else 0.0


@fulmen.rollout
async def agent(task: dict[str, Any], llm: fulmen.LLM) -> float:
    """Ask the question once; the reward says whether the answer is exactly right."""
    # A plain OpenAI client works as is: ``llm.base_url`` already points at this attempt's endpoint.
    # (``llm.async_client`` is the same client ready-made, which also passes the trace context on.)
    async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key) as client:
        response = await client.chat.completions.create(
            model=llm.model,
            messages=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": task["question"]},
            ],
            **llm.sampling_parameters,
        )
    reply = response.choices[0].message.content
    fulmen.emit_message(f"reply: {reply}")
    return score(reply, task["answer"])
