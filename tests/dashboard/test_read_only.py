"""The dashboard never writes to Redis unless admin actions are enabled: every page, every bad request
and every refused admin action, checked against the server's own command statistics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from seed import seed

from fulmen.settings import DashboardSettings
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen_dashboard.app import DashboardApp


@pytest.fixture
async def own_redis(tmp_path: Path) -> AsyncIterator[aioredis.Redis]:
    """A server of its own: its command statistics see nobody else's commands."""
    with EmbeddedRedis(tmp_path / "redis", port=None) as server:
        client = aioredis.from_url(server.url)
        yield client
        await client.aclose()


async def _commands_run(client: aioredis.Redis) -> set[str]:
    stats = await client.info("commandstats")
    return {name.removeprefix("cmdstat_").split("|")[0] for name in stats}


async def _writes(client: aioredis.Redis, commands: set[str]) -> set[str]:
    writes = set()
    for name in commands:
        reply = await client.execute_command("COMMAND", "INFO", name)  # redis-py parses it: {name: {"flags": ...}}
        flags = {f.decode() if isinstance(f, bytes) else f for info in reply.values() for f in info["flags"]}
        if "write" in flags:
            writes.add(name)
    return writes


async def test_no_write_without_admin(own_redis: aioredis.Redis) -> None:
    """All pages, bad input and refused POSTs: the server ran no command flagged 'write'."""
    store = RedisStore(own_redis, "ro")
    ids = await seed(store)
    letter = (await store.dead_letters.query_dead_letters())[0].dead_letter_id
    await own_redis.config_resetstat()
    app = DashboardApp(DashboardSettings(experiment="ro"), client=own_redis)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dash.test") as client:
        for path in ["/", "/e/ro", "/e/ro/rollouts", "/e/ro/rollouts?status=succeeded&min_reward=0.5&limit=2",
                     f"/e/ro/rollouts/{ids[0]}", "/e/ro/live", "/e/ro/live?fragment=1", "/e/ro/live",
                     "/e/ro/curves", "/e/ro/curves.json", "/e/ro/dead-letters", "/e/nope", "/e/ro/rollouts/nope",
                     "/e/ro/rollouts?limit=99999"]:
            assert (await client.get(path)).status_code < 500, path
        assert (await client.post("/e/ro/rollouts/wait-0/cancel")).status_code == 403
        assert (await client.post(f"/e/ro/dead-letters/{letter}/requeue")).status_code == 403
    commands = await _commands_run(own_redis)
    assert "hmget" in commands and "xrevrange" in commands  # the pages did read
    assert await _writes(own_redis, commands - {"config"}) == set()
    # the check itself sees writes: the same action with admin actions enabled is one
    admin = DashboardApp(DashboardSettings(experiment="ro", dashboard_admin=True), client=own_redis)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=admin), base_url="http://dash.test") as client:
        assert (await client.post(f"/e/ro/dead-letters/{letter}/requeue")).status_code == 303
    assert "xadd" in await _writes(own_redis, await _commands_run(own_redis))
