"""An experiment split into store shards (FULMEN_STORE_SHARDS) on a real 3-master Redis Cluster: each
shard on its own master, claims spread over the shards with none starved, and the views and consumer
groups that span shards see all of them. One shard keeps every key exactly as before."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis_cluster import EmbeddedCluster
from shard_ids import ids_per_shard

from fulmen import keys as k
from fulmen.errors import InvalidInput
from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.browse import RolloutFilter, browse_rollouts
from fulmen.store.redis.connection import async_client, sync_client
from fulmen.store.rollouts import ENQUEUE_CHUNK
from fulmen.store.statistics import read_snapshot

SHARDS = 3


@pytest.fixture
async def sharded(redis_cluster: EmbeddedCluster, experiment: str) -> AsyncIterator[RedisStore]:
    client = async_client(redis_cluster.url)
    yield RedisStore(client, experiment, shards=SHARDS)
    await client.aclose()


def _ids_per_shard(store: RedisStore, n: int) -> list[str]:
    """``n`` rollout ids of each shard, shard by shard."""
    by_shard = ids_per_shard(SHARDS, n)
    return [rid for shard in range(SHARDS) for rid in by_shard[shard]]


def test_one_shard_keeps_todays_keys_and_shards_land_on_distinct_masters(redis_cluster: EmbeddedCluster) -> None:
    one = k.Keys("exp", shards=1)
    assert [s.prefix for s in one.shards] == ["fulmen:{exp}:"]
    assert (one.rollout("r1"), one.attempt("r1.2"), one.queue) == (
        "fulmen:{exp}:rollout:r1", "fulmen:{exp}:attempt:r1.2", "fulmen:{exp}:queue"
    )
    three = k.Keys("exp", shards=SHARDS)
    assert three.shards[0].prefix == "fulmen:{exp}:"  # the experiment-wide keys stay where they were
    assert sorted(redis_cluster.node_of_key(s.prefix) for s in three.shards) == [0, 1, 2]
    # a rollout's keys all carry its shard's tag: one slot for every lifecycle script
    shard = three.shard("r7")
    assert {three.rollout("r7"), three.attempt("r7.1"), three.spans("r7")} == {
        shard.prefix + "rollout:r7", shard.prefix + "attempt:r7.1", shard.prefix + "spans:r7"
    }


async def test_claims_rotate_over_shards_and_views_sum_them(sharded: RedisStore) -> None:
    store = sharded
    ids = _ids_per_shard(store, 4)
    await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout(i, rollout_id=i) for i in ids])
    stats = await store.statistics()
    assert (stats["queue_depth"], stats["rollouts"]["queuing"]) == (len(ids), len(ids))
    # Each call starts one shard further: three single claims take one rollout from each shard.
    firsts = [await store.queue.dequeue_rollout("w") for _ in range(SHARDS)]
    assert sorted(store.keys.shard(c.rollout.rollout_id).index for c in firsts if c) == [0, 1, 2]
    # A larger claim fills up from every shard; all are claimed exactly once.
    rest = await store.queue.dequeue_rollouts("w", 100)
    claimed = [c.rollout.rollout_id for c in firsts if c] + [c.rollout.rollout_id for c in rest]
    assert sorted(claimed) == sorted(ids)
    stats = await store.statistics()
    assert (stats["queue_depth"], stats["rollouts"]["preparing"], stats["active_attempts"]) == (0, 12, 12)
    assert stats["pending"] == {"w": 0}
    assert sorted(r.rollout_id for r in await store.rollouts.query_rollouts(status="preparing")) == sorted(ids)


async def test_finished_groups_and_the_adapter_span_shards(sharded: RedisStore) -> None:
    store = sharded
    ids = _ids_per_shard(store, 2)
    await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout(i, rollout_id=i) for i in ids])
    await store.finished.ensure_finished_group(k.ADAPTER_GROUP)
    for c in await store.queue.dequeue_rollouts("w", len(ids)):
        await store.rollouts.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status="succeeded")
    assert {r.rollout_id for r in await store.finished.wait_for_rollouts(ids, timeout_s=5)} == set(ids)

    finished = await store.finished.read_finished(k.ADAPTER_GROUP, "a1", count=100, block_s=1)
    assert sorted(f.rollout_id for f in finished) == sorted(ids)
    rows = await store.samples.read_for_samples([f.rollout_id for f in finished])
    assert [r.rollout_id if r else None for r in rows] == [f.rollout_id for f in finished]
    assert {r.status for r in rows if r} == {RolloutStatus.SUCCEEDED}
    batch: list[Any] = [(f.rollout_id, [b"sample-" + f.rollout_id.encode()], {"adapted": 1}, "v1") for f in finished]
    ack = [f.entry_id for f in finished]
    assert await store.samples.append_samples(batch, ack_group=k.ADAPTER_GROUP, ack_entry_ids=ack) == [1] * len(ids)
    # Once per rollout, the entries acknowledged in every shard, the model version with each rollout.
    assert await store.samples.append_samples(batch) == [0] * len(ids)
    assert await store.finished.read_finished(k.ADAPTER_GROUP, "a1", count=100, pending=True) == []
    assert (await store.samples.adapter_stats())["adapted"] == len(ids)
    assert await store.redis.xlen(store.keys.samples) == len(ids)
    assert {(await store.redis.hget(store.keys.rollout(rid), "model_version")) for rid in ids} == {b"v1"}
    assert await store.samples.append_samples([("ghost", [b"x"], {})]) == [-1]


async def test_a_process_with_another_shard_count_is_refused(redis_cluster: EmbeddedCluster, experiment: str) -> None:
    client = async_client(redis_cluster.url)
    try:
        await RedisStore(client, experiment, shards=SHARDS).rollouts.enqueue_rollout("x", rollout_id="r1")
        with pytest.raises(InvalidInput, match="FULMEN_STORE_SHARDS=3"):
            await RedisStore(client, experiment, shards=1).queue.dequeue_rollout("w")
    finally:
        await client.aclose()


def test_a_bad_shard_setting_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(k.SHARDS_ENV, "zero")
    with pytest.raises(InvalidInput, match=k.SHARDS_ENV):
        k.Keys("exp")


@pytest.mark.parametrize("statuses", [(), ("queuing",)], ids=["index", "status-sets"])
async def test_the_rollout_browser_pages_over_every_shard(sharded: RedisStore, statuses: tuple[str, ...]) -> None:
    """The dashboard's pages, newest first, hold every shard's rollouts once each (small pages, so the
    cursor crosses shards and equal enqueue times)."""
    store = sharded
    ids = _ids_per_shard(store, 5)
    for i in range(0, len(ids), 4):  # several rollouts per enqueue: some share an enqueue time
        await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout(rid, rollout_id=rid) for rid in ids[i:i + 4]])
    seen: list[str] = []
    times: list[float] = []
    cursor = None
    while True:
        page = await browse_rollouts(store.redis, store.keys, RolloutFilter(statuses=frozenset(statuses)),
                                     limit=4, cursor=cursor)
        assert page.total == len(ids)
        seen += [row.rollout_id for row in page.rows]
        times += [row.enqueue_time for row in page.rows]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert sorted(seen) == sorted(ids)
    assert times == sorted(times, reverse=True)


async def test_the_sync_snapshot_of_top_and_metrics_sums_the_shards(
    sharded: RedisStore, redis_cluster: EmbeddedCluster
) -> None:
    """`fulmen top` and the metrics read with a sync client: on the cluster, over every shard."""
    store = sharded
    ids = _ids_per_shard(store, 2)
    await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout(i, rollout_id=i) for i in ids])
    claimed = await store.queue.dequeue_rollouts("w", 2)
    client = sync_client(redis_cluster.url)
    try:
        snap = await asyncio.to_thread(read_snapshot, client, store.keys)
    finally:
        client.close()
    assert (snap.queue_depth, snap.active_attempts) == (len(ids) - len(claimed), len(claimed))
    assert snap.stream_lengths["queue"] == len(ids)
    assert snap.groups[("queue", k.RUNNERS_GROUP)].pending == 0


async def test_poison_on_another_shard_is_dead_lettered_and_requeued(sharded: RedisStore) -> None:
    """A bad entry on a shard's queue goes to the experiment's dead letters (another slot) and back."""
    store = sharded
    await store.queue.ensure()
    shard = store.keys.shards[2]
    await store.redis.xadd(shard.queue, {"m": b"not msgpack"})
    assert await store.queue.dequeue_rollouts("w", 5) == []
    [letter] = await store.dead_letters.query_dead_letters()
    assert letter.source == shard.queue
    assert (await store.redis.xpending(shard.queue, k.RUNNERS_GROUP))["pending"] == 0
    await store.dead_letters.requeue_dead_letter(letter.dead_letter_id)
    assert await store.dead_letters.query_dead_letters() == []
    assert await store.redis.xlen(shard.queue) == 2


async def test_a_large_enqueue_reports_each_rollout_in_order(sharded: RedisStore) -> None:
    """enqueue_rollouts sends one script call per shard and chunk of rollouts: the flags still come back
    in the caller's order, a rollout repeated within the batch is created once, each is queued once."""
    ids = [f"big{i:04d}" for i in range(ENQUEUE_CHUNK * 2 + 7)]
    await sharded.rollouts.enqueue_rollouts([sharded.rollouts.new_rollout("old", rollout_id=ids[150])])
    batch = [sharded.rollouts.new_rollout(i, rollout_id=i) for i in ids] + [sharded.rollouts.new_rollout("again", rollout_id=ids[3])]
    flags = await sharded.rollouts.enqueue_rollouts(batch)
    assert flags == [i != 150 for i in range(len(ids))] + [False]
    assert (await sharded.rollouts.get_rollout(ids[3])).input == ids[3]
    assert (await sharded.rollouts.get_rollout(ids[150])).input == "old"
    stats = await sharded.statistics()
    assert stats["rollouts"]["queuing"] == len(ids)
    claimed = await sharded.queue.dequeue_rollouts("w", count=len(ids) + 5)
    assert sorted(c.rollout.rollout_id for c in claimed) == ids
