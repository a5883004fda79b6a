"""Retention over every shard and every stream: an entry some consumer group has not acknowledged
survives every trim, acknowledged old ones go, each stream no group reads goes only by its own rule,
and served weight versions survive."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator

import pytest
from shard_ids import ids_per_shard

from fulmen.errors import InvalidInput, NotFound
from fulmen.keys import POLICY_RESOURCES_ID
from fulmen.records import ProxyEndpoint, Span
from fulmen.retention.trim import RetentionPolicy, trim
from fulmen.store import RedisStore
from fulmen.store.redis.connection import async_client
from fulmen.versions.retention import record_stored, stored_versions

SHARDS = 3


@pytest.fixture
async def sharded(redis_url: str, experiment: str) -> AsyncIterator[RedisStore]:
    """The experiment in 3 store shards, on one node and on the 3-master cluster."""
    client = async_client(redis_url)
    await client.ping()
    yield RedisStore(client, experiment, shards=SHARDS)
    await client.aclose()


def _ids_per_shard(store: RedisStore, n: int) -> dict[int, list[str]]:
    return ids_per_shard(SHARDS, n)


async def test_every_shard_keeps_what_a_group_has_not_acknowledged(sharded: RedisStore) -> None:
    """On each shard: claimed queue entries go, unclaimed stay; finished entries both groups
    acknowledged go with their spans, the first one the algorithm has not acknowledged stays with
    everything after it."""
    store = sharded
    await store.finished.ensure_finished_group("adapter")
    await store.finished.ensure_finished_group("algorithm")
    by_shard = _ids_per_shard(store, 3)
    for ids in by_shard.values():
        for rid in ids[:2]:
            await store.rollouts.enqueue_rollout({"task": rid}, rollout_id=rid)
    claimed = await store.queue.dequeue_rollouts("w", 6)
    assert len(claimed) == 6
    for ids in by_shard.values():  # one more per shard, never claimed
        await store.rollouts.enqueue_rollout({"task": ids[2]}, rollout_id=ids[2])
    for c in claimed:
        aid = c.attempt.attempt_id
        await store.spans.add_spans([Span(c.rollout.rollout_id, aid, "s1", "llm")])
        await store.rollouts.update_attempt(c.rollout.rollout_id, aid, status="succeeded")
    done = await store.finished.read_finished("adapter", "a", count=10)
    await store.finished.ack_finished("adapter", [f.entry_id for f in done])
    algorithm = await store.finished.read_finished("algorithm", "b", count=10)
    assert len(algorithm) == 6
    # the algorithm leaves shard 1's first finished entry unacknowledged
    held = next(f for f in algorithm if store.keys.shard(f.rollout_id).index == 1)
    await store.finished.ack_finished("algorithm", [f.entry_id for f in algorithm if f is not held])

    report = await trim(store, RetentionPolicy(max_count=0))

    assert (report.queue_entries, report.finished, report.span_streams) == (6, 4, 4)
    for shard in store.keys.shards:
        assert await store.redis.xlen(shard.queue) == 1  # the unclaimed entry of each shard
        assert report.streams[shard.queue] == 2
    assert await store.redis.xlen(store.keys.shards[1].finished) == 2  # pending in the algorithm: kept
    for index in (0, 2):
        assert await store.redis.xlen(store.keys.shards[index].finished) == 0
    for c in claimed:
        rid = c.rollout.rollout_id
        assert (len(await store.spans.query_spans(rid)) == 1) == (store.keys.shard(rid).index == 1)
    unclaimed = await store.queue.dequeue_rollouts("w", 10)
    assert sorted(c.rollout.rollout_id for c in unclaimed) == sorted(ids[2] for ids in by_shard.values())


async def test_samples_pending_or_undelivered_survive(sharded: RedisStore) -> None:
    """Samples the trainers group acknowledged go; a pending one and those never delivered stay;
    without any group nothing goes, however old."""
    store, key = sharded, sharded.keys.samples
    ids = [await store.redis.xadd(key, {"m": f"s{i}"}) for i in range(5)]
    assert (await trim(store, RetentionPolicy(max_count=0))).samples == 0  # no group reads it yet
    await store.redis.xgroup_create(key, "trainers", id="0")
    await store.redis.xreadgroup("trainers", "t", {key: ">"}, count=3)
    await store.redis.xack(key, "trainers", ids[0], ids[2])  # ids[1] pending, ids[3:] undelivered

    report = await trim(store, RetentionPolicy(max_count=0))

    assert report.samples == 1
    assert [e for e, _ in await store.redis.xrange(key)] == ids[1:]


async def test_random_deliveries_and_acks_never_lose_an_unacknowledged_entry(sharded: RedisStore) -> None:
    """Over random reads and acknowledgements by two groups, a trim removes exactly the prefix that
    both groups acknowledged, and never an entry either still needs."""
    store, key = sharded, sharded.keys.samples
    rng = random.Random(18)
    for group in ("trainers", "archive"):
        await store.redis.xgroup_create(key, group, id="0", mkstream=True)
    alive: list[bytes] = []
    acked: dict[str, set[bytes]] = {"trainers": set(), "archive": set()}
    for _round in range(12):
        alive += [await store.redis.xadd(key, {"m": "x"}) for _ in range(rng.randint(0, 6))]
        for group in acked:
            if rng.random() < 0.3:
                continue  # this group reads nothing this round
            reply = await store.redis.xreadgroup(group, "c", {key: ">"}, count=rng.randint(1, 5))
            delivered = [e for e, _ in reply[0][1]] if reply else []
            chosen = [e for e in delivered if rng.random() < 0.7]
            if chosen:
                await store.redis.xack(key, group, *chosen)
                acked[group] |= set(chosen)
        await trim(store, RetentionPolicy(max_count=0, streams=frozenset({"samples"})))
        remaining = [e for e, _ in await store.redis.xrange(key)]
        both = acked["trainers"] & acked["archive"]
        expected = alive[next((i for i, e in enumerate(alive) if e not in both), len(alive)):]
        assert remaining == expected
        alive = remaining


async def test_resources_log_keeps_what_stored_and_served_versions_need(sharded: RedisStore) -> None:
    """The log entries before the oldest one a served or stored version needs go, with their versions
    of the resources hash; the newest entry and each id's latest version stay."""
    store = sharded
    for n in range(1, 5):  # resources versions 1..4 publish model versions v1..v4
        await store.resources.update_resources(POLICY_RESOURCES_ID, {"llm": {"model_version": f"v{n}"}})
    await store.resources.add_resources({"prompt": "x"}, resources_id="prompts")  # version 5, names no model
    await record_stored(store, "v3", 3)
    await record_stored(store, "v4", 4)
    await store.registry.register_proxy(ProxyEndpoint("p1", "http://127.0.0.1:1", "m", "v2", time.time()))

    dry = await trim(store, RetentionPolicy(max_count=0, resources=True, streams=frozenset()), dry_run=True)
    assert dry.resources == 1 and await store.redis.xlen(store.keys.resources_log) == 5
    report = await trim(store, RetentionPolicy(max_count=0, resources=True, streams=frozenset()))

    assert report.resources == 1  # v1's entry: older than the served v2's
    assert [u.version for u in await store.resources.query_resources()] == [2, 3, 4, 5]
    with pytest.raises(NotFound):
        await store.resources.get_resources(POLICY_RESOURCES_ID, 1)
    assert (await store.resources.get_resources(POLICY_RESOURCES_ID, 2)).version == 2

    await store.registry.unregister_proxy("p1")  # nobody serves v2 now: the stored v3 is the oldest needed
    await trim(store, RetentionPolicy(max_count=0, resources=True, streams=frozenset()))
    assert [u.version for u in await store.resources.query_resources()] == [3, 4, 5]
    assert (await store.resources.get_resources("prompts")).version == 5  # the latest of each id stays


async def test_weights_keep_the_newest_and_every_served_version(sharded: RedisStore) -> None:
    """keep_versions=1 deletes the weights of old versions, never the newest nor one a proxy serves;
    a dry run only lists them."""
    store = sharded
    for n in range(1, 5):
        await store.redis.xadd(store.keys.weights(f"v{n}"), {"m": b"chunk"}, id="0-1")
        await record_stored(store, f"v{n}", n)
    await store.registry.register_proxy(ProxyEndpoint("p1", "http://127.0.0.1:1", "m", "v1", time.time()))

    dry = await trim(store, RetentionPolicy(keep_versions=1), dry_run=True)
    assert dry.weight_versions == ("v2", "v3") and len(await stored_versions(store)) == 4
    report = await trim(store, RetentionPolicy(keep_versions=1))

    assert report.weight_versions == ("v2", "v3")
    assert await stored_versions(store) == ["v1", "v4"]
    assert [await store.redis.exists(store.keys.weights(f"v{n}")) for n in range(1, 5)] == [1, 0, 0, 1]


async def test_steps_by_count_and_dead_letters_by_age(sharded: RedisStore) -> None:
    """Streams no group reads go only by their own rule: the trainer's newest N steps stay; dead
    letters older than the age go, newer ones stay; neither is touched by the consumed-stream limits."""
    store = sharded
    for step in range(1, 6):
        await store.redis.xadd(store.keys.trainer_steps, {"m": f"step{step}"})
    hour_ago = (await store.redis.time())[0] * 1000 - 3_600_000
    await store.redis.xadd(store.keys.dead_letters, {"m": "old"}, id=f"{hour_ago}-0")
    await store.redis.xadd(store.keys.dead_letters, {"m": "new"})

    untouched = await trim(store, RetentionPolicy(max_count=0))
    assert (untouched.steps, untouched.dead_letters) == (0, 0)
    report = await trim(store, RetentionPolicy(steps_max_count=2, dead_letters_max_age_s=60))

    assert (report.steps, report.dead_letters) == (3, 1)
    assert [f[b"m"] for _, f in await store.redis.xrange(store.keys.trainer_steps)] == [b"step4", b"step5"]
    assert [f[b"m"] for _, f in await store.redis.xrange(store.keys.dead_letters)] == [b"new"]


async def test_dry_run_counts_what_a_trim_removes_and_removes_nothing(sharded: RedisStore) -> None:
    """A dry run reports the same counts as the trim that follows, and leaves every stream whole."""
    store = sharded
    await store.finished.ensure_finished_group("adapter")
    for rid in [rid for ids in _ids_per_shard(store, 2).values() for rid in ids]:
        await store.rollouts.enqueue_rollout({}, rollout_id=rid)
    for c in await store.queue.dequeue_rollouts("w", 6):
        await store.spans.add_spans([Span(c.rollout.rollout_id, c.attempt.attempt_id, "s1", "llm")])
        await store.rollouts.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status="succeeded")
    acked = await store.finished.read_finished("adapter", "a", count=4)
    await store.finished.ack_finished("adapter", [f.entry_id for f in acked])
    all_ids = [r.rollout_id for r in await store.rollouts.query_rollouts()]
    await store.redis.sadd(store.keys.sampled, *all_ids)  # the adapter's once-sampled markers (sharded)
    policy = RetentionPolicy(max_count=0, delete_rollouts=True)

    dry = await trim(store, policy, dry_run=True)
    assert (dry.queue_entries, dry.finished, dry.span_streams, dry.rollouts) == (6, 4, 4, 4)
    assert sum([await store.redis.xlen(s.finished) for s in store.keys.shards]) == 6
    assert len(await store.rollouts.query_rollouts()) == 6
    real = await trim(store, policy)
    assert (real.queue_entries, real.finished, real.span_streams, real.rollouts) == (6, 4, 4, 4)
    assert real.streams == dry.streams
    kept = sorted(r.rollout_id for r in await store.rollouts.query_rollouts())
    assert kept == sorted(set(all_ids) - {f.rollout_id for f in acked})
    assert sorted(m.decode() for m in await store.redis.smembers(store.keys.sampled)) == kept  # markers go too


async def test_a_policy_must_say_what_to_trim() -> None:
    """Bad policies are refused with the reason: no limit, an unknown stream, the resources log with
    no age or count, keeping no version."""
    for bad in ({}, {"max_age_s": 1, "streams": frozenset({"spans"})}, {"resources": True, "keep_versions": 2},
                {"keep_versions": 0}, {"max_count": -1}):
        with pytest.raises(InvalidInput):
            RetentionPolicy(**bad)  # type: ignore[arg-type]


async def test_unclaimed_entries_of_every_priority_lane_survive(sharded: RedisStore) -> None:
    """The urgent and low lanes are trimmed by the same rule as the normal one: what the runners
    have not claimed stays and is claimed after the trim, urgent first."""
    store = sharded
    await store.rollouts.enqueue_rollout({}, rollout_id="n0")
    assert [c.rollout.rollout_id for c in await store.queue.dequeue_rollouts("w", 1)] == ["n0"]
    await store.rollouts.enqueue_rollout({}, rollout_id="n", priority="normal")
    await store.rollouts.enqueue_rollout({}, rollout_id="l", priority="low")
    await store.rollouts.enqueue_rollout({}, rollout_id="u", priority="urgent")
    report = await trim(store, RetentionPolicy(max_count=0))
    assert report.queue_entries == 1  # n0, claimed
    claimed = [c.rollout.rollout_id for c in await store.queue.dequeue_rollouts("w", 3)]
    assert sorted(claimed) == ["l", "n", "u"]
