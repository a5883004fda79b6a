"""Fixtures shared by the store tests: worker processes, and waiting for a blocked reader."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis_cluster import store_url

Spawn = Callable[..., Awaitable[Any]]


def _load_workers() -> ModuleType:
    """tests/store/workers.py by its path: a child runs it as a script, so it is no package module."""
    spec = importlib.util.spec_from_file_location(
        "store_test_workers", Path(__file__).with_name("workers.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


workers = _load_workers()


@pytest.fixture
async def spawn(tmp_path: Path) -> AsyncIterator[Spawn]:
    """Start worker processes; every one still alive is killed after the test."""
    async with workers.spawner(tmp_path) as start:
        yield start


@pytest.fixture(params=["single", "cluster"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """Every store test runs twice: on one node, and on a real 3-master Redis Cluster (the core ones,
    test_crash and test_stress, a third time with 3 store shards)."""
    return store_url(request, request.param)


async def _client_lists(redis: Any) -> list[dict[str, Any]]:
    """CLIENT LIST of the server, or of every node of a cluster."""
    if isinstance(redis, RedisCluster):
        replies = await redis.client_list(target_nodes=RedisCluster.ALL_NODES)
        return [c for clients in replies.values() for c in clients] if isinstance(replies, dict) else replies
    return list(await redis.client_list())


async def _wait_blocked_reader(redis: aioredis.Redis) -> None:
    """Return once some client is blocked on XREAD (so a waiter or subscriber has taken its cursor)."""
    for _ in range(500):
        clients = await _client_lists(redis)
        if any(c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in clients):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no client blocked on XREAD")


@pytest.fixture
def blocked_reader() -> Callable[[aioredis.Redis], Awaitable[None]]:
    return _wait_blocked_reader


@pytest.fixture
async def store(real_store: Any) -> Any:
    """The store tests run on a real server: claiming reads the queue inside Lua with the cmsgpack
    library Redis builds in, which fakeredis lacks (pure unit tests use ``fake_store``)."""
    return real_store
