"""APO, automatic prompt optimisation: a beam search over prompt-template resources.

Templates are scored by the normal pipeline and edited by a critic model. The search, step by step:
docs/design/algorithm.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fulmen.errors import InvalidInput, NotFound
from fulmen.records.status import RolloutMode, RolloutStatus
from fulmen.settings import ApoSettings
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.versions.model_version import POLICY_RESOURCES_ID
from fulmen_algorithm.dataset import Task, task_id

log = logging.getLogger(__name__)

# How many failed tasks the critic is shown: enough to see a pattern, few enough to keep the prompt short.
SHOWN_FAILURES = 5
# The OpenAI client needs a key even when the critic asks for none.
NO_API_KEY = "none"

GRADIENT_PROMPT = """You improve prompt templates for an AI agent.

The template:
<template>
{template}
</template>

It scored {score:.2f} (mean reward, 1.0 is perfect). Tasks it failed:
{failures}

In a few sentences, say what in the template makes the agent fail and what should change."""

EDIT_PROMPT = """You improve prompt templates for an AI agent.

The template:
<template>
{template}
</template>

A critique of it:
{critique}

Write the improved template. Keep every placeholder in braces ({placeholders}) exactly as it is.
Answer with the template only, nothing before or after it."""


@dataclass
class Candidate:
    template: str
    score: float | None = None
    round: int = 0
    critique: str = ""
    failures: list[Task] = field(default_factory=list)

    @property
    def digest(self) -> str:
        return hashlib.blake2b(self.template.encode(), digest_size=6).hexdigest()


def placeholders(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


@dataclass(frozen=True)
class BeamSearch:
    """The search's shape: templates kept per round, edits asked per template, rounds."""

    beam_width: int = 2
    branch_factor: int = 2
    rounds: int = 2


class APO:
    def __init__(
        self,
        store: RedisStore,
        tasks: Sequence[Task],
        critic: Any,  # an openai.AsyncOpenAI
        critic_model: str,
        search: BeamSearch,
        *,
        base_resources_id: str | None = POLICY_RESOURCES_ID,
        timeout_s: float = 300.0,
    ) -> None:
        self.store = store
        self.tasks = list(tasks)
        self.critic = critic
        self.critic_model = critic_model
        self.beam_width = search.beam_width
        self.branch_factor = search.branch_factor
        self.rounds = search.rounds
        self.base_resources_id = base_resources_id
        self.timeout_s = timeout_s
        self.history: list[Candidate] = []

    async def _resources_id(self, candidate: Candidate) -> str:
        rid = f"apo-{candidate.digest}"
        base: dict[str, Any] = {}
        if self.base_resources_id:
            try:
                base = dict((await self.store.resources.get_resources(self.base_resources_id)).resources)
            except NotFound:  # no policy resources: the agent may not need an LLM
                base = {}
        with contextlib.suppress(InvalidInput):  # published before: the same snapshot serves again
            await self.store.resources.add_resources({**base, "prompt_template": {"template": candidate.template}}, resources_id=rid)
        return rid

    async def score(self, candidate: Candidate) -> float:
        """Mean reward of the template over the tasks, by rollouts through the runners."""
        rid = await self._resources_id(candidate)
        rollouts = [
            self.store.rollouts.new_rollout(t, rollout_id=f"{rid}-{task_id(t)}", mode=RolloutMode.VAL, resources_id=rid)
            for t in self.tasks
        ]
        await self.store.rollouts.enqueue_rollouts(rollouts)
        finished = {r.rollout_id: r for r in await self.store.finished.wait_for_rollouts(
            [r.rollout_id for r in rollouts], timeout_s=self.timeout_s)}
        rewards = []
        candidate.failures = []
        for task, rollout in zip(self.tasks, rollouts, strict=True):
            reward = 0.0
            done = finished.get(rollout.rollout_id)
            if done is not None and done.status is RolloutStatus.SUCCEEDED:
                spans = await self.store.spans.query_spans(rollout.rollout_id, "latest", name=semconv.REWARD_SPAN)
                if spans:
                    reward = float(spans[-1].attributes.get(semconv.REWARD, 0.0))
            rewards.append(reward)
            if reward < 1.0:
                candidate.failures.append(task)
        candidate.score = sum(rewards) / len(rewards) if rewards else 0.0
        log.info("template %s scored %.3f", candidate.digest, candidate.score)
        return candidate.score

    async def _ask(self, prompt: str) -> str:
        reply = await self.critic.chat.completions.create(
            model=self.critic_model, messages=[{"role": "user", "content": prompt}]
        )
        return (reply.choices[0].message.content or "").strip()

    async def expand(self, candidate: Candidate, round_: int) -> list[Candidate]:
        """A critique of the candidate, then ``branch_factor`` edits of it."""
        failures = "\n".join(f"- {t}" for t in candidate.failures[:SHOWN_FAILURES]) or "(none)"
        candidate.critique = await self._ask(
            GRADIENT_PROMPT.format(template=candidate.template, score=candidate.score or 0.0, failures=failures)
        )
        needed = placeholders(candidate.template)
        edits = []
        for _ in range(self.branch_factor):
            text = await self._ask(EDIT_PROMPT.format(
                template=candidate.template, critique=candidate.critique,
                placeholders=", ".join("{" + p + "}" for p in sorted(needed)) or "none",
            ))
            text = text.removeprefix("<template>").removesuffix("</template>").strip()
            if not text or not needed <= placeholders(text):
                log.info("discarded an edit that drops a placeholder or is empty")
                continue
            edits.append(Candidate(text, round=round_))
        return edits

    async def run(self, initial: str) -> Candidate:
        beam = [Candidate(initial)]
        await self.score(beam[0])
        self.history.append(beam[0])
        for round_ in range(1, self.rounds + 1):
            children = []
            for parent in beam:
                for child in await self.expand(parent, round_):
                    if all(child.template != c.template for c in self.history + children):
                        children.append(child)
            for child in children:
                await self.score(child)
            self.history += children
            # sorted() is stable: on equal scores the elder template stays ahead
            beam = sorted(beam + children, key=lambda c: -(c.score or 0.0))[: self.beam_width]
            log.info("APO round %d: best %.3f (%s)", round_, beam[0].score or 0.0, beam[0].digest)
        return beam[0]


async def optimise(
    store: RedisStore, tasks: Sequence[Task], settings: ApoSettings, template: str, *,
    rounds: int, beam_width: int, branch_factor: int,
) -> dict[str, Any]:
    """The beam search with the settings' critic; the best template is published as resources
    ``apo-best-<digest>``. The best template, its score and every template scored."""
    import openai

    key = settings.critic_api_key.get_secret_value() if settings.critic_api_key else NO_API_KEY
    critic = openai.AsyncOpenAI(base_url=settings.critic_base_url, api_key=key)
    shape = BeamSearch(beam_width=beam_width, branch_factor=branch_factor, rounds=rounds)
    search = APO(store, tasks, critic, settings.critic_model or "", shape)
    best = await search.run(template)
    await store.resources.add_resources({"prompt_template": {"template": best.template}}, resources_id=f"apo-best-{best.digest}")
    return {"template": best.template, "score": best.score,
            "history": [{"template": c.template, "score": c.score, "round": c.round} for c in search.history]}
