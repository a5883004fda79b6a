"""APO against a scripted critic: of one good and one bad edit, the good one is kept."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import openai

from fulmen.sdk.agent import load_agent
from fulmen.settings import RunnerSettings
from fulmen.store import RedisStore
from fulmen.telemetry.tracing import setup_tracing
from fulmen_algorithm.apo import APO, BeamSearch, placeholders
from fulmen_runner.runner import Runner

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the fakes
from fakes.fake_openai import FakeOpenAI

TASKS = [{"id": f"q{i}", "question": f"{i}+{i}="} for i in range(4)]
GOOD = "Think step by step, then answer: {question}"
BAD = "Answer at once: {question}"


async def test_apo_keeps_the_good_edit_and_drops_the_bad(real_store: RedisStore) -> None:
    """Rollouts score the critic's two edits; the beam keeps the good one, which wins."""
    critic = FakeOpenAI(replies=["The template never asks for reasoning.", GOOD, BAD, "wrong {placeholder}"])
    base_url = critic.start_in_thread()
    _, buffer = setup_tracing("apo-test", set_global=False)
    runner = Runner(real_store, load_agent("apo_agents:template_judge"), buffer, RunnerSettings(concurrency=8))
    running = asyncio.create_task(runner.run())
    try:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="test")
        apo = APO(real_store, TASKS, client, "critic", BeamSearch(beam_width=1, branch_factor=3, rounds=1), timeout_s=60)
        best = await apo.run("Answer: {question}")
    finally:
        runner.stop()
        await running
        critic.stop()
    assert best.template == GOOD and best.score == 1.0
    scores = {c.template: c.score for c in apo.history}
    assert scores == {"Answer: {question}": 0.0, GOOD: 1.0, BAD: 0.0}  # the placeholder-dropping edit: unscored
    prompts = [r.body["messages"][0]["content"] for r in critic.requests]
    assert "Answer: {question}" in prompts[0] and "scored 0.00" in prompts[0] and "q0" in prompts[0]
    assert "never asks for reasoning" in prompts[1]


def test_placeholders() -> None:
    """The named fields of a template (an edit must keep them)."""
    assert placeholders("Solve {question} in {lang}, {{literal}}") == {"question", "lang"}
