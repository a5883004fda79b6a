"""Fixtures for the framework examples: one torch-backend proxy serving the tiny model per module,
and `fulmen run-once` children on the proxy's experiment (helpers from tests/runner and tests/llm_proxy)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "runner"), str(TESTS / "llm_proxy")]  # runner_processes, proxy_helpers

import proxy_fixtures  # noqa: E402
from runner_processes import FulmenProcesses, fulmen_processes  # noqa: E402

from fulmen.demo.tiny_model import TinyModelSpec, build_tiny_model  # noqa: E402
from fulmen.store.redis.embedded import EmbeddedRedis  # noqa: E402

# one proxy per module (the model loads once): every example's calls go through it
torch_proxy = proxy_fixtures.torch_proxy
proxy_store = proxy_fixtures.proxy_store


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the template renders each request's tools (their JSON schemas) into the prompt: a context that
    # holds a few turns of an agent with a tool
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TinyModelSpec(max_position_embeddings=2048))


@pytest.fixture(scope="module")
def module_experiment() -> str:
    return f"fw-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def procs(tmp_path: Path, redis_server: EmbeddedRedis, module_experiment: str) -> AsyncIterator[FulmenProcesses]:
    async with fulmen_processes(tmp_path, redis_server.url, module_experiment) as processes:
        yield processes
