"""Priority lanes (`fulmen.store.queue`): urgent rollouts are claimed within the stated bound however
deep the queue, no lane starves (each gets its stated share), a requeue keeps the lane, and a queue
that only ever sees the normal lane claims exactly as before lanes. Runs on one node and on the
3-master cluster (the ``redis_url`` fixture), and with 3 store shards for the cross-shard bound."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from redis_cluster import EmbeddedCluster

from fulmen import keys as k
from fulmen.errors import InvalidInput
from fulmen.records import Priority, QueueEntry
from fulmen.records.status import RolloutMode, RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.experiments import delete_experiment
from fulmen.store.lua.claim import CLAIM_CYCLE
from fulmen.store.redis.connection import async_client
from fulmen.store.statistics import aread_snapshot
from fulmen.watchdog import sweep

URGENT_BOUND = 2  # entries delivered from the urgent rollout's shard (the queue module's docstring)
DEADLINE_S = 0.3  # the watchdog test's deadline, with a sleep well past it (server clock)


async def _fill(store: RedisStore, lane: str, n: int) -> list[str]:
    rollouts = [store.rollouts.new_rollout(i, rollout_id=f"{lane}-{i:03d}", priority=lane) for i in range(n)]
    await store.rollouts.enqueue_rollouts(rollouts)
    return [r.rollout_id for r in rollouts]


async def _claim_one(store: RedisStore) -> tuple[str, Priority]:
    [claimed] = await store.queue.dequeue_rollouts("w1", 1)
    return claimed.rollout.rollout_id, claimed.rollout.priority


def test_lanes_are_the_priorities() -> None:
    assert tuple(p.value for p in Priority) == k.LANES
    with pytest.raises(InvalidInput, match="priority 'asap' unknown; use urgent, normal, low"):
        Priority.parse("asap")


async def test_priority_on_enqueue_and_its_default(store: RedisStore) -> None:
    """A rollout keeps the priority it was queued with; validation rollouts are urgent unless told."""
    assert store.rollouts.new_rollout("x").priority is Priority.NORMAL
    assert store.rollouts.new_rollout("x", mode=RolloutMode.VAL).priority is Priority.URGENT
    assert store.rollouts.new_rollout("x", mode="val", priority="low").priority is Priority.LOW
    with pytest.raises(InvalidInput, match="priority 'high' unknown"):
        store.rollouts.new_rollout("x", priority="high")
    stored = await store.rollouts.enqueue_rollout("x", rollout_id="r1", priority="low")
    assert stored.priority is Priority.LOW
    assert [await store.redis.xlen(q) for q in store.keys.shard("r1").queues] == [0, 0, 1]
    snap = await aread_snapshot(store.redis, store.keys)  # what status, top and the metrics show
    assert (snap.queue_depth, snap.stream_lengths["queue"]) == (1, 1)
    assert snap.groups[("queue", k.RUNNERS_GROUP)].lag_entries in (None, 1)  # Redis 7 counts it


async def test_urgent_pushed_last_is_claimed_within_the_bound(store: RedisStore) -> None:
    """With normal and low lanes saturated, an urgent rollout pushed at any position of the claim
    cycle is among the next URGENT_BOUND claims; the queue depth counts every lane."""
    await _fill(store, "normal", 40)
    await _fill(store, "low", 40)
    assert (await store.statistics())["queue_depth"] == 80
    waits = []
    for phase in range(CLAIM_CYCLE):  # every position of the cycle, in turn
        urgent = f"urgent-{phase}"
        await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout(phase, rollout_id=urgent, priority="urgent")])
        for n in range(1, CLAIM_CYCLE + 1):
            if (await _claim_one(store))[0] == urgent:
                waits.append(n)
                break
        else:
            raise AssertionError(f"urgent rollout of phase {phase} not claimed within {CLAIM_CYCLE} claims")
    assert max(waits) <= URGENT_BOUND, waits
    assert max(waits) == URGENT_BOUND  # the bound is reached: a normal- or low-first turn came first
    assert (await store.statistics())["queue_depth"] == 80 + CLAIM_CYCLE - sum(waits)


async def test_no_lane_starves_under_a_flood(store: RedisStore) -> None:
    """All lanes full: of every 8 consecutive claims, 6 are urgent, 1 normal, 1 low. Once the urgent
    lane is drained, low still gets 1 in 8 against a deep normal lane."""
    await _fill(store, "urgent", 24)
    await _fill(store, "normal", 60)
    await _fill(store, "low", 20)
    lanes = [(await _claim_one(store))[1] for _ in range(4 * CLAIM_CYCLE)]  # the 24 urgent ones
    for start in range(0, len(lanes), CLAIM_CYCLE):
        window = Counter(lanes[start : start + CLAIM_CYCLE])
        assert window == {Priority.URGENT: 6, Priority.NORMAL: 1, Priority.LOW: 1}, (start, window)
    lanes = [(await _claim_one(store))[1] for _ in range(4 * CLAIM_CYCLE)]
    for start in range(0, len(lanes), CLAIM_CYCLE):
        window = Counter(lanes[start : start + CLAIM_CYCLE])
        assert window == {Priority.NORMAL: 7, Priority.LOW: 1}, (start, window)


async def test_normal_lane_alone_claims_as_before(store: RedisStore) -> None:
    """Only normal rollouts: a batch claim takes them in order and writes no turn counter; claimed
    urgent entries leave their lane empty (so the claim is back to the one read)."""
    ids = await _fill(store, "normal", 5)
    claimed = await store.queue.dequeue_rollouts("w1", 5)
    assert [c.rollout.rollout_id for c in claimed] == ids
    turn = store.keys.shards[0].prefix + k.QUEUE_TURN
    assert await store.redis.exists(turn) == 0
    await _fill(store, "urgent", 3)
    assert len(await store.queue.dequeue_rollouts("w1", 5)) == 3
    assert await store.redis.xlen(store.keys.shards[0].lane_queue("urgent")) == 0
    assert await store.redis.exists(turn) == 1


async def test_blocked_claim_wakes_for_an_urgent_rollout(store: RedisStore) -> None:
    """A runner blocked on an empty queue reads every lane: an urgent rollout wakes it."""
    await store.queue.ensure()
    waiter = asyncio.create_task(store.queue.dequeue_rollouts("w1", 1, block_s=3))
    await asyncio.sleep(0.2)  # let it block
    await _fill(store, "urgent", 1)
    claimed = await waiter  # [] if the blocking read had not looked at the urgent lane
    assert [c.rollout.rollout_id for c in claimed] == ["urgent-000"]


async def test_entries_beyond_the_count_are_held_for_the_next_claim(store: RedisStore) -> None:
    """A blocking read answered by two lanes at once delivers more than asked: the urgent entry is
    claimed now, the other on the next claim, and none is left pending."""
    await store.queue.ensure()
    await _fill(store, "low", 1)
    await _fill(store, "urgent", 1)
    entries = await store.queue._read_lanes(0, "w1", 1, None)
    assert [(lane, item[0]) for lane, _, item in entries] == [(0, "urgent-000")]
    first = await store.queue._claim_entries(0, "w1", entries)
    second = await store.queue.dequeue_rollouts("w1", 5)
    assert [c.rollout.rollout_id for c in first + second] == ["urgent-000", "low-000"]
    for queue in store.keys.shards[0].queues:
        assert (await store.redis.xpending(queue, k.RUNNERS_GROUP))["pending"] == 0


async def test_lanes_recover_after_the_experiment_is_deleted(store: RedisStore) -> None:
    """Deleted under a running store (its groups gone), the experiment's lanes work again: a low and
    an urgent rollout queued afterwards are both claimed, urgent first."""
    await _fill(store, "normal", 1)
    assert len(await store.queue.dequeue_rollouts("w1", 1)) == 1
    await delete_experiment(store.redis, store.experiment)
    await _fill(store, "low", 1)
    await _fill(store, "urgent", 1)
    claimed = await store.queue.dequeue_rollouts("w1", 2) or await store.queue.dequeue_rollouts("w1", 2)
    assert [c.rollout.rollout_id for c in claimed] == ["urgent-000", "low-000"]


async def test_a_poison_entry_on_a_lane_is_dead_lettered_and_leaves_it(store: RedisStore) -> None:
    """An urgent-lane entry whose rollout does not exist goes to the dead letters and off the lane,
    so the lane is empty again (and the claim back to reading the normal lane alone)."""
    await store.queue.ensure()
    urgent = store.keys.shards[0].lane_queue("urgent")
    ghost = (await store.redis.xadd(urgent, {"m": QueueEntry("ghost").to_wire()})).decode()
    assert await store.queue.dequeue_rollouts("w1", 1) == []
    [letter] = await store.dead_letters.query_dead_letters()
    assert (letter.source, letter.entry_id) == (urgent, ghost)
    assert await store.redis.xlen(urgent) == 0


async def test_requeue_keeps_the_priority(store: RedisStore) -> None:
    """The watchdog's requeue and a released attempt put a low rollout back on the low lane."""
    config = {"timeout_seconds": DEADLINE_S, "max_attempts": 3, "retry_condition": ["timeout"]}
    await store.rollouts.enqueue_rollout("x", rollout_id="r1", priority="low", config=config)
    low, normal = store.keys.shard("r1").lane_queue("low"), store.keys.shard("r1").queue
    claimed = await store.queue.dequeue_rollout("w1")
    assert claimed is not None and await store.redis.xlen(low) == 0
    await asyncio.sleep(DEADLINE_S * 1.5)
    assert await sweep(store) == Counter({"requeued": 1})
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.REQUEUING
    assert (await store.redis.xlen(low), await store.redis.xlen(normal)) == (1, 0)
    claimed = await store.queue.dequeue_rollout("w1")
    assert claimed is not None and claimed.attempt.attempt_id == "r1.2"
    assert claimed.rollout.priority is Priority.LOW
    assert await store.rollouts.release_attempt("r1", "r1.2")
    assert (await store.redis.xlen(low), await store.redis.xlen(normal)) == (1, 0)


@pytest.fixture
async def sharded(redis_cluster: EmbeddedCluster, experiment: str) -> AsyncIterator[RedisStore]:
    client = async_client(redis_cluster.url)
    yield RedisStore(client, experiment, shards=3)
    await client.aclose()


async def test_urgent_bound_across_shards(sharded: RedisStore) -> None:
    """3 shards, all saturated: a runner claiming one at a time visits them in turn, so an urgent
    rollout is claimed within its next 2·S claims, whatever its shard."""
    store, shards = sharded, 3
    await _fill(store, "normal", 60)
    await _fill(store, "low", 60)
    for phase in range(6):
        urgent = f"urgent-{phase}"
        await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout(phase, rollout_id=urgent, priority="urgent")])
        for n in range(1, 4 * shards * URGENT_BOUND):
            if (await _claim_one(store))[0] == urgent:
                assert n <= URGENT_BOUND * shards, (phase, n)
                break
        else:
            raise AssertionError(f"urgent rollout {urgent} not claimed")
    # every lane stream of every shard has its group, in its shard's slot
    for shard in store.keys.shards:
        for queue in shard.queues:
            assert (await store.redis.xinfo_groups(queue))[0]["name"] == k.RUNNERS_GROUP.encode()


async def test_status_counts_what_waits_in_each_lane(store: RedisStore) -> None:
    """`fulmen status`, `top` and the metrics show the queue depth per lane: what is queued, less what
    runners have claimed, whatever lane it was claimed from."""
    await _fill(store, "urgent", 3)
    await _fill(store, "normal", 5)
    await _fill(store, "low", 2)
    snap = await aread_snapshot(store.redis, store.keys)
    assert snap.queue_depth_by_lane == {"urgent": 3, "normal": 5, "low": 2}
    claimed = Counter(lane.value for _, lane in [await _claim_one(store) for _ in range(8)])
    assert claimed == {"urgent": 3, "normal": 4, "low": 1}  # the claim rule's cycle of 8
    assert (await store.statistics())["queue_depth_by_lane"] == {"urgent": 0, "normal": 1, "low": 1}
