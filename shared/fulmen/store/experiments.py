"""Experiments: several share one Redis, each under its own key prefix; list them, delete one."""

from __future__ import annotations

import redis.asyncio as aioredis

from fulmen import keys as k

SCAN_BATCH = 1000  # keys per SCAN step and per UNLINK: small enough that Redis never blocks long


async def list_experiments(redis: aioredis.Redis) -> list[str]:
    return sorted(x.decode() for x in await redis.smembers(k.EXPERIMENTS))


async def delete_experiment(redis: aioredis.Redis, experiment: str) -> int:
    """Delete every key of one experiment (SCAN + UNLINK, so Redis never blocks). Returns keys deleted.

    Stop the experiment's services first: a runner still polling recreates the empty queue."""
    keys = k.Keys(experiment)
    deleted = 0
    batch: list[bytes] = []
    for pattern in keys.patterns():  # shard 0's keys, then the other shards' (any number of them)
        async for key in redis.scan_iter(match=pattern, count=SCAN_BATCH):
            batch.append(key)
            if len(batch) >= SCAN_BATCH:
                deleted += await redis.unlink(*batch)
                batch.clear()
        if batch:
            deleted += await redis.unlink(*batch)
            batch.clear()
    await redis.srem(k.EXPERIMENTS, experiment)
    return deleted
