"""Fixtures for the framework examples: one torch-backend proxy serving the tiny model per module,
and `fulmen run-once` children on the proxy's experiment (helpers from tests/runner and tests/llm_proxy)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "runner"), str(TESTS / "llm_proxy")]  # runner_processes, proxy_helpers

from proxy_helpers import RunningProxy  # noqa: E402
from runner_processes import FulmenProcesses, fulmen_processes  # noqa: E402

from fulmen.embedded import EmbeddedRedis  # noqa: E402
from fulmen.store import RedisStore  # noqa: E402
from fulmen.tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the template renders each request's tools (their JSON schemas) into the prompt: a context that
    # holds a few turns of an agent with a tool
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def module_experiment() -> str:
    return f"fw-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def torch_proxy(redis_server: EmbeddedRedis, tiny_model: Path, module_experiment: str) -> Iterator[RunningProxy]:
    """One proxy for the module (the model loads once); every example's calls go through it."""
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=module_experiment, proxy_backend="torch", model_dir=tiny_model
    )
    yield proxy
    proxy.stop()


@pytest.fixture
async def proxy_store(redis_server: EmbeddedRedis, module_experiment: str) -> AsyncIterator[RedisStore]:
    client = aioredis.from_url(redis_server.url)
    yield RedisStore(client, module_experiment)
    await client.aclose()


@pytest.fixture
async def procs(tmp_path: Path, redis_server: EmbeddedRedis, module_experiment: str) -> AsyncIterator[FulmenProcesses]:
    async with fulmen_processes(tmp_path, redis_server.url, module_experiment) as processes:
        yield processes
