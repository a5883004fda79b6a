"""Waiting for rollouts on a redis-py client as redis-py makes it by default (with a socket timeout)."""

from __future__ import annotations

import redis.asyncio as aioredis

from fulmen.store import RedisStore


async def test_wait_for_rollouts_outlasts_the_clients_socket_timeout(redis_url: str, experiment: str) -> None:
    """A wait longer than the client's socket timeout ends at its own timeout, not with a TimeoutError."""
    client = aioredis.from_url(redis_url, socket_timeout=1.0)
    try:
        store = RedisStore(client, experiment)
        rollout = await store.rollouts.enqueue_rollout({"never": "claimed"})
        assert await store.finished.wait_for_rollouts([rollout.rollout_id], timeout_s=2.5) == []
    finally:
        await client.aclose()
