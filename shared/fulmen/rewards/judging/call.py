"""`judge`: an LLM scores a group of trajectories relative to each other, in one call (ART's RULER):
every trajectory numbered in the prompt, a JSON answer with a score in [0, 1] and a reason for each.
A malformed answer is sent back once with what is wrong; a second one is a `JudgeError`.

Its calls are marked and never trained on (`fulmen.rewards.judging.client`). More: docs/guides/rewards.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from fulmen.errors import FulmenError
from fulmen.rewards.judging.answer import Malformed, scores_in
from fulmen.rewards.judging.client import judge_client
from fulmen.rewards.judging.prompt import DEFAULT_RUBRIC, messages_for
from fulmen.rewards.verdict import Verdict

OPERATION = "fulmen.judge"


class JudgeError(FulmenError):
    """The judge's answers could not be read (each try's problem is in the message)."""


async def judge(
    trajectories: Sequence[Any],
    *,
    rubric: str = DEFAULT_RUBRIC,
    client: Any = None,
    model: str | None = None,
    task: str | None = None,
    retries: int = 1,
    options: Mapping[str, Any] | None = None,
) -> list[Verdict]:
    """One `Verdict` per trajectory, in their order: ``await judge([t1, t2, t3], client=llm)``.

    A trajectory is a list of chat messages (``{"role", "content", "tool_calls"}``), a mapping with
    ``"messages"``, or text. ``client``: the agent's ``llm`` (its proxy, the attempt's, and its model),
    an OpenAI client (with ``model``), or None (``openai.AsyncOpenAI()`` from the environment).
    ``task``: what the trajectories attempt, shown first. ``retries``: how many more times a
    malformed answer is sent back. ``options``: more arguments of ``chat.completions.create``."""
    if not trajectories:
        return []
    from fulmen.sdk.emit import operation  # here: importing the SDK costs the import of OpenTelemetry

    made = judge_client(client, model)
    messages = messages_for(trajectories, rubric, task)
    problems = []
    try:
        with operation(OPERATION, **{"fulmen.judge.model": made.model, "fulmen.judge.trajectories": len(trajectories)}) as op:
            for _ in range(retries + 1):
                text = await _ask(made.client, made.model, messages, options or {})
                try:
                    verdicts = scores_in(text, len(trajectories))
                except Malformed as e:
                    problems.append(str(e))
                    messages = [*messages, {"role": "assistant", "content": text or ""},
                                {"role": "user", "content": f"That answer cannot be used: {e}. Answer again "
                                                            "with the JSON object only."}]
                    continue
                op.set_output([[float(v), v.reason] for v in verdicts])
                return verdicts
    finally:
        await made.close()
    raise JudgeError(f"the judge ({made.model}) answered {len(problems)} times without usable scores: "
                     + "; ".join(problems))


async def _ask(client: Any, model: str, messages: list[dict[str, str]], options: Mapping[str, Any]) -> str | None:
    response = client.chat.completions.create(model=model, messages=messages, **options)
    if inspect.isawaitable(response):  # an AsyncOpenAI client; a sync one has answered already
        response = await response
    return response.choices[0].message.content
