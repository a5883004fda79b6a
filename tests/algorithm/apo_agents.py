"""The agent APO is tested on: its reward says how good the prompt template is, no LLM needed."""

from __future__ import annotations

from typing import Any

import fulmen


@fulmen.prompt_rollout
async def template_judge(task: Any, prompt_template: fulmen.PromptTemplate) -> float:
    """Reward 1 when the formatted prompt asks to work step by step and keeps the question."""
    prompt = prompt_template.format(question=task["question"])
    return float("step by step" in prompt and task["question"] in prompt)
