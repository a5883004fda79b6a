"""Validation passes against a real Redis: a pass survives the death of the runner holding its rollouts."""

from __future__ import annotations

import asyncio

from fulmen.store import RedisStore
from fulmen.store.watchdog import sweep
from fulmen_algorithm.scheduler import recoverable_rollout_config
from fulmen_algorithm.validation import validate

TASKS = [{"id": f"q{i}", "question": f"{i}+1=", "answer": str(i + 1)} for i in range(2)]


async def test_a_pass_finishes_when_the_runner_holding_its_rollouts_dies(real_store: RedisStore) -> None:
    """Validation rollouts carry a heartbeat deadline: the watchdog requeues a dead runner's attempts."""
    await real_store.add_resources({"llm": {"kind": "llm", "model": "tiny", "model_version": "v1"}},
                                   resources_id="policy")
    config = recoverable_rollout_config(unresponsive_s=0.1)
    running = asyncio.create_task(validate(real_store, TASKS, label="v1", timeout_s=30, config=config))
    claimed: list = []
    while len(claimed) < 2:  # the runner that dies: claims both, then nothing more from it
        claimed += await real_store.dequeue_rollouts("runner-that-dies", 2, block_s=0.5)
    await asyncio.sleep(0.3)
    assert (await sweep(real_store))["requeued"] == 2
    for c in await real_store.dequeue_rollouts("another-runner", 2, block_s=5):
        await real_store.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status="succeeded")
    result = await asyncio.wait_for(running, 30)
    assert result["finished"] == 2
