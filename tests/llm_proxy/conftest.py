"""Fixtures for the proxy: a tiny model, the proxy served by uvicorn in a thread, attempts to attribute to.

The proxy runs in its own thread and event loop (as it runs in its own process in production), so
tests can call it with the sync and the async openai clients alike and read the store from theirs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import proxy_fixtures
import pytest
from fakes.fake_openai import FakeOpenAI
from proxy_helpers import RunningProxy

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis

# shared with the framework examples' tests (tests/examples/conftest.py): pytest finds them by these names
torch_proxy = proxy_fixtures.torch_proxy
proxy_store = proxy_fixtures.proxy_store


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a character tokenizer, served as model "tiny"."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def module_experiment() -> str:
    return f"px-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def attempt(proxy_store: RedisStore) -> tuple[str, str]:
    """A running attempt to attribute calls to: (rollout id, attempt id)."""
    started = await proxy_store.rollouts.start_rollout({"task": "test"}, "test-worker")
    return started.rollout.rollout_id, started.attempt.attempt_id


@pytest.fixture(scope="module")
def chat_upstream() -> Iterator[FakeOpenAI]:
    """A fake OpenAI-compatible upstream on loopback (scripted replies, tool calls included)."""
    fake = FakeOpenAI()
    fake.start_in_thread()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def upstream_proxy(
    redis_server: EmbeddedRedis, module_experiment: str, chat_upstream: FakeOpenAI
) -> Iterator[RunningProxy]:
    """A proxy on the openai backend in front of `chat_upstream`."""
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=module_experiment, proxy_backend="openai",
        upstream_urls=chat_upstream.base_url, model_name="fake-model",
    )  # fmt: skip
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def vllm_api_proxy(redis_server: EmbeddedRedis, module_experiment: str) -> Iterator[tuple[RunningProxy, FakeOpenAI]]:
    """A proxy on the vllm backend in front of a fake vLLM server (token ids and log-probabilities)."""
    fake = FakeOpenAI(vllm=True, default_reply="four")
    fake.start_in_thread()
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=module_experiment, proxy_backend="vllm", upstream_urls=fake.base_url
    )
    yield proxy, fake
    proxy.stop()
    fake.stop()
