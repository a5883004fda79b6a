"""Crashes: a worker killed or frozen while it holds attempts, and a consumer that died between reading
queue entries and claiming them. Every rollout is recovered and finishes exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis_cluster import store_url

from fulmen import keys as k
from fulmen.records import RolloutConfig, RolloutFinished
from fulmen.records.status import AttemptStatus, RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.redis.connection import async_client
from fulmen.watchdog import run_watchdog


@pytest.fixture(params=["single", "cluster", "cluster-3-shards"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """The core store tests run a third time: on the cluster with the experiment in 3 shards."""
    return store_url(request, request.param)

Spawn = Callable[..., Awaitable[Any]]  # what the `spawn` fixture (conftest.py) gives


CONFIG = RolloutConfig(unresponsive_seconds=1.0, max_attempts=2, retry_condition=("unresponsive",))


@contextlib.asynccontextmanager
async def _watchdog(store: RedisStore) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_watchdog(store, interval_s=0.1, stop=stop))
    try:
        yield
    finally:
        stop.set()
        await task


async def _hold(store: RedisStore, spawn: Spawn, redis_url: str, ids: list[str]) -> Any:
    """A worker process that claimed every rollout and heartbeats them (all running now)."""
    await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout(i, rollout_id=i, config=CONFIG) for i in ids])
    holder = await spawn(
        "hold",
        url=redis_url,
        experiment=store.experiment,
        worker_id="doomed",
        count=len(ids),
        heartbeat_s=0.2,
    )
    held = (await holder.event())["held"]
    assert sorted(held) == [[rid, f"{rid}.1"] for rid in ids]
    attempts = [await store.rollouts.get_attempt(f"{rid}.1") for rid in ids]
    assert {(a.status, a.worker_id) for a in attempts} == {(AttemptStatus.RUNNING, "doomed")}
    return holder


async def _rescue(store: RedisStore, spawn: Spawn, redis_url: str, ids: list[str]) -> list[list[str]]:
    """Run the watchdog while a second worker process takes over and finishes every rollout."""
    rescuer = await spawn(
        "run", url=redis_url, experiment=store.experiment, worker_id="rescuer", count=len(ids), timeout_s=30
    )
    assert "ready" in await rescuer.event()
    async with _watchdog(store):
        return (await rescuer.event())["ran"]


async def _assert_recovered_once(store: RedisStore, ids: list[str]) -> None:
    """Attempt 1 of each rollout unresponsive, attempt 2 succeeded; one finished entry per rollout."""
    finished = [
        RolloutFinished.from_wire(fields[b"m"])
        for shard in store.keys.shards
        for _, fields in await store.redis.xrange(shard.finished)
    ]
    assert sorted((c.rollout_id, c.status, c.attempt_id) for c in finished) == [
        (rid, RolloutStatus.SUCCEEDED, f"{rid}.2") for rid in ids
    ]
    for rid in ids:
        attempts = await store.rollouts.query_attempts(rid)
        assert [(a.attempt_id, a.status, a.worker_id) for a in attempts] == [
            (f"{rid}.1", AttemptStatus.UNRESPONSIVE, "doomed"),
            (f"{rid}.2", AttemptStatus.SUCCEEDED, "rescuer"),
        ]
    stats = await store.statistics()
    assert stats["rollouts"] == {
        s.value: len(ids) if s is RolloutStatus.SUCCEEDED else 0 for s in RolloutStatus
    }
    assert stats["heartbeat_watched"] == 0
    assert set(stats["pending"].values()) == {0}


@pytest.mark.slow
async def test_killed_worker_rollouts_finish_once_elsewhere(
    real_store: RedisStore, redis_url: str, spawn: Spawn
) -> None:
    """A worker SIGKILLed holding 50 attempts: the watchdog requeues them, another worker finishes each once."""
    ids = [f"r{i:02d}" for i in range(50)]
    holder = await _hold(real_store, spawn, redis_url, ids)
    holder.signal(signal.SIGKILL)
    assert await holder.wait() == -signal.SIGKILL

    ran = await _rescue(real_store, spawn, redis_url, ids)

    assert sorted(ran) == [[rid, f"{rid}.2", "succeeded"] for rid in ids]
    await _assert_recovered_once(real_store, ids)


@pytest.mark.slow
async def test_frozen_worker_wakes_to_change_nothing(
    real_store: RedisStore, redis_url: str, spawn: Spawn
) -> None:
    """A worker frozen (SIGSTOP) past its heartbeat whose rollouts were recovered reports success in vain."""
    ids = [f"r{i:02d}" for i in range(50)]
    holder = await _hold(real_store, spawn, redis_url, ids)
    holder.signal(signal.SIGSTOP)

    ran = await _rescue(real_store, spawn, redis_url, ids)
    holder.signal(signal.SIGCONT)
    await holder.send("finish")
    finished = (await holder.event())["finished"]

    assert sorted(ran) == [[rid, f"{rid}.2", "succeeded"] for rid in ids]
    # Its attempts had ended and a newer one drives each rollout: the late reports change nothing.
    assert sorted(finished) == [[rid, f"{rid}.1", "superseded"] for rid in ids]
    await _assert_recovered_once(real_store, ids)


async def test_entries_of_a_dead_consumer_are_taken_over_once(
    real_store: RedisStore, redis_url: str, experiment: str
) -> None:
    """Queue entries read by a consumer that died before claiming them are XAUTOCLAIMed once idle, each once."""
    ids = [f"r{i:02d}" for i in range(20)]
    await real_store.rollouts.enqueue_rollouts([real_store.rollouts.new_rollout(i, rollout_id=i) for i in ids])
    # The dead consumer read every entry (so they are pending to it) and never ran the claim script.
    shards = real_store.keys.shards
    read = [await real_store.redis.xreadgroup(k.RUNNERS_GROUP, "dead", {s.queue: ">"}, count=100) for s in shards]
    assert sum(len(reply[0][1]) for reply in read if reply) == len(ids)
    clients = [async_client(redis_url) for _ in range(2)]
    takers = [RedisStore(c, experiment, reclaim_idle_s=0.2) for c in clients]
    try:
        # Not idle long enough yet: nothing is taken over, and nothing new is on the queue.
        assert await takers[0].queue.dequeue_rollouts("w0", 5) == []
        pending = [await real_store.redis.xpending(s.queue, k.RUNNERS_GROUP) for s in shards]
        assert sum(p["pending"] for p in pending) == len(ids)
        assert {c["name"] for p in pending for c in p["consumers"]} == {b"dead"}

        # Past the idle time two workers race to take them over, five per call each.
        claimed = []
        for _ in range(10):
            await asyncio.sleep(0.25)  # past the idle time and each taker's reclaim interval
            batches = await asyncio.gather(*(t.queue.dequeue_rollouts(f"w{n}", 5) for n, t in enumerate(takers)))
            claimed += [c for batch in batches for c in batch]
            if len(claimed) >= len(ids):
                break
        await asyncio.sleep(0.25)
        assert [await t.queue.dequeue_rollouts(f"w{n}", 5) for n, t in enumerate(takers)] == [[], []]
    finally:
        for c in clients:
            await c.aclose()

    assert sorted(c.attempt.attempt_id for c in claimed) == [f"{rid}.1" for rid in ids]
    assert {c.attempt.worker_id for c in claimed} <= {"w0", "w1"}
    assert [(await real_store.redis.xpending(s.queue, k.RUNNERS_GROUP))["pending"] for s in shards] == [0] * len(shards)
    rollouts = await real_store.rollouts.get_rollouts(ids)
    assert {(r.status, r.attempt_count) if r else None for r in rollouts} == {(RolloutStatus.PREPARING, 1)}
