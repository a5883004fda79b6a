"""Many OS processes on one store at once: every rollout is claimed, and every stale attempt ended,
exactly once."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from redis_cluster import store_url

from fulmen import keys as k
from fulmen.records import Attempt, RolloutConfig, RolloutFinished
from fulmen.records.status import AttemptStatus, RolloutStatus
from fulmen.store import RedisStore


@pytest.fixture(params=["single", "cluster", "cluster-3-shards"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """The core store tests run a third time: on the cluster with the experiment in 3 shards."""
    return store_url(request, request.param)

Spawn = Callable[..., Awaitable[Any]]  # what the `spawn` fixture (conftest.py) gives


async def _release_together(processes: Sequence[Any]) -> None:
    """Wait until every process is connected, then let them all go at once."""
    for process in processes:
        assert "ready" in await process.event()
    await asyncio.gather(*(process.send("go") for process in processes))


async def _attempts(store: RedisStore, attempt_ids: Sequence[str]) -> list[Attempt]:
    pipe = store.redis.pipeline(transaction=False)
    for aid in attempt_ids:
        pipe.hgetall(store.keys.attempt(aid))
    return [Attempt.from_hash(raw) for raw in await pipe.execute()]


def _per_status(**counts: int) -> dict[str, int]:
    return {s.value: counts.get(s.value, 0) for s in RolloutStatus}


@pytest.mark.slow
@pytest.mark.parametrize("reclaim_idle_s", [10.0, 0.001], ids=["read", "read-and-steal"])
async def test_claims_are_exclusive_across_processes(
    real_store: RedisStore, redis_url: str, experiment: str, spawn: Spawn, reclaim_idle_s: float
) -> None:
    """8 processes claiming 2,000 rollouts at once claim each exactly once, as its first attempt."""
    # "read-and-steal": every claim also XAUTOCLAIMs entries idle for 1 ms, so workers take over
    # entries delivered to each other before those are claimed; the claim script must still let one win.
    ids = [f"r{i:04d}" for i in range(2000)]
    assert await real_store.rollouts.enqueue_rollouts(
        [real_store.rollouts.new_rollout({"i": i}, rollout_id=i) for i in ids]
    ) == [True] * len(ids)
    names = [f"w{n}" for n in range(8)]
    processes = [
        await spawn(
            "claim",
            url=redis_url,
            experiment=experiment,
            worker_id=name,
            batch=10,
            reclaim_idle_s=reclaim_idle_s,
        )
        for name in names
    ]
    await _release_together(processes)
    results = {name: (await p.event())["claimed"] for name, p in zip(names, processes, strict=True)}

    claims = [(rid, aid, wid, name) for name, claimed in results.items() for rid, aid, wid in claimed]
    assert sorted(rid for rid, *_ in claims) == ids
    assert [(aid, wid) for rid, aid, wid, name in claims] == [
        (f"{rid}.1", name) for rid, _, _, name in claims
    ]
    attempts = await _attempts(real_store, [aid for _, aid, _, _ in claims])
    assert [(a.attempt_id, a.status, a.worker_id) for a in attempts] == [
        (aid, AttemptStatus.PREPARING, name) for _, aid, _, name in claims
    ]
    rollouts = await real_store.rollouts.get_rollouts(ids)
    assert {(r.status, r.attempt_count) if r else None for r in rollouts} == {(RolloutStatus.PREPARING, 1)}
    stats = await real_store.statistics()
    assert stats["rollouts"] == _per_status(preparing=len(ids))
    assert set(stats["pending"].values()) == {0}
    for shard in real_store.keys.shards:
        assert (await real_store.redis.xpending(shard.queue, k.RUNNERS_GROUP))["pending"] == 0
    assert await real_store.queue.dequeue_rollouts("late", 10) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("max_attempts", "outcome"), [(2, "requeued"), (1, "failed")], ids=["retry", "no-retry"]
)
async def test_racing_watchdogs_end_each_stale_attempt_once(
    real_store: RedisStore,
    redis_url: str,
    experiment: str,
    spawn: Spawn,
    max_attempts: int,
    outcome: str,
) -> None:
    """3 watchdog processes sweeping 500 stale attempts at once end each exactly once."""
    config = RolloutConfig(
        unresponsive_seconds=0.5, max_attempts=max_attempts, retry_condition=("unresponsive",)
    )
    ids = [f"r{i:03d}" for i in range(500)]
    await real_store.rollouts.enqueue_rollouts([real_store.rollouts.new_rollout(i, rollout_id=i, config=config) for i in ids])
    claimed = await real_store.queue.dequeue_rollouts("sleeper", len(ids))
    assert sorted(c.attempt.attempt_id for c in claimed) == [f"{rid}.1" for rid in ids]
    processes = [await spawn("watchdog", url=redis_url, experiment=experiment) for _ in range(3)]
    for process in processes:
        assert "ready" in await process.event()
    await asyncio.sleep(0.6)  # past unresponsive_seconds, with no heartbeat
    seconds, micros = await real_store.redis.time()
    overdue = sum([await real_store.redis.zcount(shard.watch_heartbeat, "-inf", seconds + micros / 1e6)
                   for shard in real_store.keys.shards])
    assert overdue == len(ids)
    await asyncio.gather(*(process.send("go") for process in processes))
    outcomes: Counter[str] = Counter()
    for process in processes:
        outcomes.update((await process.event())["outcomes"])

    assert {code: n for code, n in outcomes.items() if code != "already"} == {outcome: len(ids)}
    attempts = await _attempts(real_store, [f"{rid}.1" for rid in ids])
    assert {(a.status, a.worker_id) for a in attempts} == {(AttemptStatus.UNRESPONSIVE, "sleeper")}
    assert [await real_store.redis.zcard(s.watch_heartbeat) for s in real_store.keys.shards] == [0] * len(
        real_store.keys.shards
    )
    completions = [
        RolloutFinished.from_wire(fields[b"m"])
        for shard in real_store.keys.shards
        for _, fields in await real_store.redis.xrange(shard.finished)
    ]
    if outcome == "requeued":
        assert (await real_store.statistics())["rollouts"] == _per_status(requeuing=len(ids))
        assert completions == []
        # Requeued once each: the queue holds one new entry per rollout, claimed as attempt 2.
        again = await real_store.queue.dequeue_rollouts("second", 2 * len(ids))
        assert sorted(c.attempt.attempt_id for c in again) == [f"{rid}.2" for rid in ids]
    else:
        assert (await real_store.statistics())["rollouts"] == _per_status(failed=len(ids))
        assert sorted((c.rollout_id, c.status, c.attempt_id) for c in completions) == [
            (rid, RolloutStatus.FAILED, f"{rid}.1") for rid in ids
        ]
        assert await real_store.queue.dequeue_rollouts("second", 10) == []
