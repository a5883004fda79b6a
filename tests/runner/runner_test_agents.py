"""Agents the runner tests run, in-process and in runner subprocesses (``runner_test_agents:<name>``)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import fulmen
from fulmen.records import Rollout


@fulmen.rollout
async def noop(task: Any, llm: Any) -> float:
    """Emits 8 spans (7 messages, then the reward) and returns 1.0."""
    for i in range(7):
        fulmen.emit_message(f"step {i}")
    return 1.0


@fulmen.rollout
def sync_agent(task: Any, rollout: Rollout) -> float:
    """A sync agent (runs in a worker thread) that uses the rollout record."""
    fulmen.emit_object({"rollout": rollout.rollout_id, "task": task})
    return float(task.get("reward", 0.5)) if isinstance(task, dict) else 0.5


@fulmen.rollout
async def raises(task: Any) -> float:
    raise ValueError(f"bad task {task!r}")


@fulmen.rollout
async def hangs(task: Any) -> float:
    await asyncio.sleep(3600)
    return 0.0


@fulmen.rollout
async def slow(task: Any) -> float:
    """Sleeps task["sleep_s"] seconds, emitting a message every 0.1 s."""
    end = time.monotonic() + float(task.get("sleep_s", 1.0))
    while time.monotonic() < end:
        fulmen.emit_message("working")
        await asyncio.sleep(0.1)
    return 1.0


@fulmen.rollout
def sync_slow(task: Any) -> float:
    time.sleep(float(task.get("sleep_s", 1.0)))
    return 1.0


@fulmen.rollout
async def flaky(task: Any, rollout: Rollout) -> float:
    """Fails its first attempt, succeeds on the next."""
    if rollout.attempt_id and rollout.attempt_id.endswith(".1"):
        raise RuntimeError("first attempt fails")
    return 1.0


@fulmen.rollout
async def nan_reward(task: Any) -> float:
    return float("nan")


@fulmen.rollout
async def returns_text(task: Any) -> str:
    return "done"


@fulmen.rollout
async def named_rewards(task: Any) -> None:
    fulmen.emit_reward({"format": 1.0, "correct": 0.0}, primary="correct")


@fulmen.rollout
async def with_operation(task: Any) -> float:
    @fulmen.operation
    def add(a: int, b: int) -> int:
        return a + b

    with fulmen.operation("lookup") as op:
        op.set_output({"hits": 3})
    return float(add(1, 2))


@fulmen.rollout
async def pid_agent(task: Any) -> float:
    """Records which process ran it, and sleeps task["sleep_s"] (default 0)."""
    fulmen.emit_message(f"pid {os.getpid()}")
    await asyncio.sleep(float(task.get("sleep_s", 0)) if isinstance(task, dict) else 0)
    return 1.0


class ClassAgent(fulmen.Agent):
    """A class agent with hooks that record their order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def rollout_async(self, task: Any, llm: Any, rollout: Rollout) -> float:
        self.calls.append("rollout")
        return 0.25

    def on_rollout_start(self, rollout: Rollout) -> None:
        self.calls.append("on_rollout_start")

    def on_trace_start(self, rollout: Rollout) -> None:
        self.calls.append("on_trace_start")

    def on_trace_end(self, rollout: Rollout) -> None:
        self.calls.append("on_trace_end")

    def on_rollout_end(self, rollout: Rollout, result: Any) -> None:
        self.calls.append(f"on_rollout_end:{result}")


def wrong_signature(task: Any, client: Any) -> float:  # "client" is no input the runner knows
    return 0.0


NOT_AN_AGENT = 42


@fulmen.rollout
def sync_sleeps(task: Any) -> float:
    """A sync agent that says it started, then sleeps task["sleep_s"] in its thread (nothing can interrupt it)."""
    fulmen.emit_message("started")
    time.sleep(float(task.get("sleep_s", 1.0)))
    return 1.0


@fulmen.rollout
async def bracket_text(task: Any) -> float:
    """Emits text with square brackets, as chat templates have ("[INST] ... [/INST]")."""
    fulmen.emit_message("[INST] What is 2 + 2? [/INST] 4")
    return 1.0


async def calls_llm(task: Any, llm: Any) -> float:
    """One chat call through the LLM it was handed (tests point it at a proxy that is not there)."""
    await llm.async_client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "hi"}])
    return 1.0
