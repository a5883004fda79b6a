"""Fixtures for the runner tests: the test agents, and a runner running in this process."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from runner_processes import FulmenProcesses, fulmen_processes

from fulmen.sdk.agent import load_agent
from fulmen.settings import RunnerSettings
from fulmen.store import RedisStore
from fulmen.telemetry.tracing import setup_tracing
from fulmen_runner.runner import Runner

AGENTS_DIR = Path(__file__).parent
sys.path.insert(0, str(AGENTS_DIR))  # `runner_test_agents` for in-process runners

StartRunner = Callable[..., Awaitable[Runner]]


@pytest.fixture
async def procs(tmp_path: Path, redis_url: str, experiment: str) -> AsyncIterator[FulmenProcesses]:
    """Real `fulmen` processes (runners, watchdogs, run-once), every one killed after the test."""
    async with fulmen_processes(tmp_path, redis_url, experiment) as processes:
        yield processes


@pytest.fixture
async def start_runner(real_store: RedisStore) -> AsyncIterator[StartRunner]:
    """Start in-process runners (`Runner.run` as a task); all are stopped after the test."""
    started: list[tuple[Runner, asyncio.Task[None]]] = []

    async def start(agent: str | Any, **kwargs: Any) -> Runner:
        the_agent = load_agent(f"runner_test_agents:{agent}") if isinstance(agent, str) else agent
        _, buffer = setup_tracing("test-runner", set_global=False)
        runner = Runner(real_store, the_agent, buffer, RunnerSettings(**kwargs))
        started.append((runner, asyncio.create_task(runner.run())))
        return runner

    yield start
    for runner, _ in started:
        runner.stop()
    for runner, task in started:
        await asyncio.wait_for(task, timeout=runner.grace_s + 10)
