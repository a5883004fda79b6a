"""The proxy fixtures the proxy tests and the framework examples' tests share, imported by both
conftests (tests/llm_proxy, tests/examples); each conftest brings its own `tiny_model` and
`module_experiment`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from proxy_helpers import RunningProxy

from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis


@pytest.fixture(scope="module")
def torch_proxy(redis_server: EmbeddedRedis, tiny_model: Path, module_experiment: str) -> Iterator[RunningProxy]:
    """One torch-backend proxy per test module (loading the model once)."""
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=module_experiment, proxy_backend="torch", model_dir=tiny_model
    )
    yield proxy
    proxy.stop()


@pytest.fixture
async def proxy_store(redis_server: EmbeddedRedis, module_experiment: str) -> AsyncIterator[RedisStore]:
    """The store of the module's proxy experiment, on the test's event loop."""
    client = aioredis.from_url(redis_server.url)
    yield RedisStore(client, module_experiment)
    await client.aclose()
