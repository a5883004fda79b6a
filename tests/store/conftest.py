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


async def _wait_blocked_reader(redis: aioredis.Redis) -> None:
    """Return once some client is blocked on XREAD (so a waiter or subscriber has taken its cursor)."""
    for _ in range(500):
        clients = await redis.client_list()
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
