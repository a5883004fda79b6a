"""The demo's agent: answer an arithmetic question in one chat call; the reward is checked exactly.

    fulmen run-once --agent examples.arithmetic_agent:agent --task '{"question": "23+48=", "answer": "71"}'
    fulmen runner --agent examples.arithmetic_agent:agent --concurrency 16

The sampling parameters (temperature 1.0 while training, 0 for greedy validation) come with the
LLM resource, so the same agent serves both.
"""

from __future__ import annotations

from typing import Any

import fulmen
from fulmen.demo import arithmetic


@fulmen.rollout
async def agent(task: dict[str, Any], llm: fulmen.LLM) -> float:
    params = {"max_tokens": 6, **llm.sampling_parameters}
    reply = await llm.async_client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["question"]}], **params
    )
    return arithmetic.reward(task, reply.choices[0].message.content)
