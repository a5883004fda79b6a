"""Joined claims: one worker's concurrent claims in one loop iteration become one claim script call."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis_cluster import store_url

from fulmen.store import RedisStore


@pytest.fixture(params=["single", "cluster", "cluster-3-shards"])
def redis_url(request: pytest.FixtureRequest) -> str:
    return store_url(request, request.param)


def _counting_claims(store: RedisStore) -> list[int]:
    """Record the count of every claim the queue runs for the joined callers."""
    counts: list[int] = []
    inner = store.queue._join._claim

    async def claim(worker_id: str, count: int, block_s: float | None) -> Any:
        counts.append(count)
        return await inner(worker_id, count, block_s)

    store.queue._join._claim = claim
    return counts


async def test_concurrent_claims_of_one_worker_are_one_claim_and_each_gets_its_own(store: RedisStore) -> None:
    """Eight slots of one worker claiming one each at once: one claim of 8, eight distinct rollouts in
    enqueue order, each begun once; another worker's claim is not joined with them."""
    for i in range(10):
        await store.rollouts.enqueue_rollout({"i": i}, rollout_id=f"r{i}")
    counts = _counting_claims(store)
    results = await asyncio.gather(
        *(store.queue.dequeue_rollouts("w1", 1, block_s=1.0) for _ in range(8)), store.queue.dequeue_rollouts("w2", 2)
    )
    assert counts in ([8, 2], [2, 8])
    slots = [[c.rollout.rollout_id for c in r] for r in results]
    assert all(len(s) == 1 for s in slots[:8]) and len(slots[8]) == 2
    claimed = [rid for s in slots for rid in s]
    assert sorted(claimed) == sorted(f"r{i}" for i in range(10))  # every rollout once, none twice
    if len(store.keys.shards) == 1:
        order = [int(s[0][1:]) for s in slots[:8]]
        assert order == sorted(order)  # callers served in call order, from the claim's enqueue order
    for rid in claimed:
        assert (await store.rollouts.get_rollout(rid)).status == "preparing"


async def test_a_joined_caller_left_without_work_still_waits_for_it(store: RedisStore) -> None:
    """Three slots join a claim that finds one rollout: the two left over keep waiting (as each would
    alone) and get the rollouts enqueued while they wait; none returns early with nothing."""
    await store.rollouts.enqueue_rollout("x", rollout_id="first")
    slots = [asyncio.create_task(store.queue.dequeue_rollouts("w1", 1, block_s=5.0)) for _ in range(3)]
    done, _ = await asyncio.wait(slots, timeout=0.5)
    assert [t.result()[0].rollout.rollout_id for t in done] == ["first"]
    await store.rollouts.enqueue_rollout("x", rollout_id="second")
    await store.rollouts.enqueue_rollout("x", rollout_id="third")
    results = await asyncio.gather(*slots)
    assert sorted(r[0].rollout.rollout_id for r in results) == ["first", "second", "third"]


async def test_rollouts_claimed_for_a_cancelled_caller_go_to_the_next_claim(store: RedisStore) -> None:
    """A caller cancelled while its joined claim runs loses nothing: the worker's next claim gets the
    attempt that was begun for it, before anything from the queue."""
    for i in range(4):
        await store.rollouts.enqueue_rollout("x", rollout_id=f"r{i}")
    inner = store.queue._join._claim
    tasks: list[asyncio.Task[Any]] = []

    async def claim(worker_id: str, count: int, block_s: float | None) -> Any:
        result = await inner(worker_id, count, block_s)
        tasks[0].cancel()  # the first caller gives up while its rollouts are being claimed
        await asyncio.sleep(0)
        return result

    store.queue._join._claim = claim
    tasks += [asyncio.create_task(store.queue.dequeue_rollouts("w1", n)) for n in (2, 1)]
    got = await tasks[1]
    assert tasks[0].cancelled() and len(got) == 1
    store.queue._join._claim = inner
    spare = await store.queue.dequeue_rollouts("w1", 5)  # the two begun for the first caller, alone
    assert len(spare) == 2
    assert {(await store.rollouts.get_rollout(c.rollout.rollout_id)).status for c in spare} == {"preparing"}
    rest = await store.queue.dequeue_rollouts("w1", 5)
    assert sorted(c.rollout.rollout_id for c in got + spare + rest) == ["r0", "r1", "r2", "r3"]


def test_a_join_left_on_a_closed_loop_does_not_block_the_next_loop() -> None:
    """A claim made just before its loop stopped (the join never started) leaves nothing that makes a
    claim on a later loop wait forever (as a sync wrapper running each call in its own loop would)."""
    from fulmen.store.redis.claim_join import ClaimJoin

    async def fake_claim(worker_id: str, count: int, block_s: float | None) -> list[str]:
        return [worker_id] * count

    join: ClaimJoin[str] = ClaimJoin(fake_claim)

    left: list[asyncio.Future[list[str]]] = []

    async def leave_one_behind() -> None:
        left.append(asyncio.ensure_future(join.claim("w1", 1, None)))  # runs one step; its join never starts

    first = asyncio.new_event_loop()
    first.run_until_complete(leave_one_behind())
    first.close()
    assert asyncio.run(asyncio.wait_for(join.claim("w1", 2, None), 5)) == ["w1", "w1"]
