"""The finished stream: once per terminal rollout, consumer groups, and waiting on it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from fulmen.errors import NotFound
from fulmen.records import RolloutFinished
from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore

BlockedReader = Callable[[aioredis.Redis], Awaitable[None]]  # the conftest.py fixture


async def _all(store: RedisStore) -> list[tuple[str, str, str | None]]:
    entries = await store.redis.xrange(store.keys.finished)
    return [
        (c.rollout_id, c.status.value, c.attempt_id)
        for c in (RolloutFinished.from_wire(f[b"m"]) for _, f in entries)
    ]


async def _run(store: RedisStore, rollout_id: str, outcome: str = "succeeded") -> None:
    """Enqueue, claim and report one rollout."""
    await store.rollouts.enqueue_rollout(rollout_id, rollout_id=rollout_id)
    claimed = await store.queue.dequeue_rollouts("w1", count=10)  # count > 1: steps over stale entries
    assert [c.rollout.rollout_id for c in claimed] == [rollout_id]
    await store.rollouts.update_attempt(rollout_id, claimed[0].attempt.attempt_id, status=outcome)


async def test_each_terminal_rollout_is_appended_once(store: RedisStore) -> None:
    """Every way of ending a rollout appends exactly one finished entry, whatever is repeated after."""
    await _run(store, "ok")
    await store.rollouts.update_attempt("ok", "ok.1", status="succeeded")  # duplicate report
    await store.rollouts.cancel_rollout("ok")  # too late

    config = {"max_attempts": 3, "retry_condition": ["failed"]}
    await store.rollouts.enqueue_rollout("retried", rollout_id="retried", config=config)
    for n in (1, 2, 3):
        assert (await store.queue.dequeue_rollout("w1")).attempt.attempt_id == f"retried.{n}"
        await store.rollouts.update_attempt("retried", f"retried.{n}", status="failed")
    await store.rollouts.update_attempt("retried", "retried.3", status="failed")  # duplicate report

    await store.rollouts.enqueue_rollout("gone", rollout_id="gone")
    await store.rollouts.cancel_rollout("gone")
    await store.rollouts.cancel_rollout("gone")

    await _run(store, "bad", "failed")
    await store.rollouts.update_rollout("bad", status="succeeded")

    assert await _all(store) == [
        ("ok", "succeeded", "ok.1"),
        ("retried", "failed", "retried.3"),
        ("gone", "cancelled", None),
        ("bad", "failed", "bad.1"),
    ]
    assert (await store.statistics())["finished"] == 4


async def test_read_and_ack_with_a_consumer_group(store: RedisStore) -> None:
    """A group reads each finished entry once; unacked ones stay pending until acked."""
    await _run(store, "a")
    await _run(store, "b", "failed")
    got = await store.finished.read_finished("adapter", "c1")
    assert [(c.rollout_id, c.status, c.attempt_id) for c in got] == [
        ("a", RolloutStatus.SUCCEEDED, "a.1"),
        ("b", RolloutStatus.FAILED, "b.1"),
    ]
    assert [c.entry_id for c in got] == [
        eid.decode() for eid, _ in await store.redis.xrange(store.keys.finished)
    ]
    assert await store.finished.read_finished("adapter", "c1") == []
    assert (await store.redis.xpending(store.keys.finished, "adapter"))["pending"] == 2
    assert await store.finished.ack_finished("adapter", [got[0].entry_id]) == 1
    assert await store.finished.ack_finished("adapter", [got[0].entry_id]) == 0  # already acked
    assert await store.finished.ack_finished("adapter", []) == 0
    assert (await store.redis.xpending(store.keys.finished, "adapter"))["pending"] == 1
    await store.finished.ack_finished("adapter", [got[1].entry_id])
    assert (await store.redis.xpending(store.keys.finished, "adapter"))["pending"] == 0

    await _run(store, "c")
    assert [c.rollout_id for c in await store.finished.read_finished("adapter", "c2")] == ["c"]


async def test_groups_are_independent_and_consumers_share(store: RedisStore) -> None:
    """Each group sees every finished entry; consumers of one group split them."""
    for rid in ["a", "b", "c"]:
        await _run(store, rid)
    assert [c.rollout_id for c in await store.finished.read_finished("algorithm", "x")] == ["a", "b", "c"]
    first = await store.finished.read_finished("adapter", "c1", count=2)
    second = await store.finished.read_finished("adapter", "c2", count=2)
    assert [c.rollout_id for c in first] == ["a", "b"]
    assert [c.rollout_id for c in second] == ["c"]


async def test_group_created_late_reads_from_the_start(store: RedisStore) -> None:
    """A group created after finished entries were appended still reads them all."""
    await _run(store, "a")
    await store.finished.ensure_finished_group("late")
    await store.finished.ensure_finished_group("late")  # idempotent
    assert [c.rollout_id for c in await store.finished.read_finished("late", "x")] == ["a"]


async def test_wait_returns_at_once_for_finished_rollouts(store: RedisStore) -> None:
    """Waiting on rollouts that already ended returns them, in the order asked."""
    await _run(store, "a")
    await _run(store, "b", "failed")
    finished = await store.finished.wait_for_rollouts(["b", "a"], timeout_s=0)
    assert [(r.rollout_id, r.status) for r in finished] == [
        ("b", RolloutStatus.FAILED),
        ("a", RolloutStatus.SUCCEEDED),
    ]


async def test_wait_unblocks_when_rollouts_finish(
    real_store: RedisStore, blocked_reader: BlockedReader
) -> None:
    """A waiter blocked on the finished stream returns once every rollout it waits on ends."""
    store = real_store
    for rid in ["a", "b"]:
        await store.rollouts.enqueue_rollout(rid, rollout_id=rid)
    waiter = asyncio.create_task(store.finished.wait_for_rollouts(["a", "b"], timeout_s=30))
    await blocked_reader(store.redis)
    claimed = await store.queue.dequeue_rollout("w1")
    await store.rollouts.update_attempt("a", claimed.attempt.attempt_id, status="succeeded")
    await blocked_reader(store.redis)  # still waiting for b
    assert not waiter.done()
    await store.rollouts.cancel_rollout("b")
    finished = await asyncio.wait_for(waiter, 5)
    assert [(r.rollout_id, r.status) for r in finished] == [
        ("a", RolloutStatus.SUCCEEDED),
        ("b", RolloutStatus.CANCELLED),
    ]


async def test_wait_returns_partial_list_on_timeout(real_store: RedisStore) -> None:
    """On timeout, the waiter returns only the rollouts that ended."""
    store = real_store
    await _run(store, "a")
    await store.rollouts.enqueue_rollout("b", rollout_id="b")
    finished = await store.finished.wait_for_rollouts(["a", "b"], timeout_s=0.3)
    assert [(r.rollout_id, r.status) for r in finished] == [("a", RolloutStatus.SUCCEEDED)]
    assert (await store.rollouts.get_rollout("b")).status is RolloutStatus.QUEUING


async def test_wait_ignores_other_rollouts_completions(
    real_store: RedisStore, blocked_reader: BlockedReader
) -> None:
    """Completions of other rollouts do not end the wait early."""
    store = real_store
    await store.rollouts.enqueue_rollout("mine", rollout_id="mine")
    waiter = asyncio.create_task(store.finished.wait_for_rollouts(["mine"], timeout_s=30))
    await blocked_reader(store.redis)
    await store.rollouts.enqueue_rollout("other", rollout_id="other")
    await store.rollouts.cancel_rollout("other")
    await blocked_reader(store.redis)
    assert not waiter.done()
    await store.rollouts.cancel_rollout("mine")
    assert [r.rollout_id for r in await asyncio.wait_for(waiter, 5)] == ["mine"]


async def test_wait_for_unknown_rollouts_raises_not_found(store: RedisStore) -> None:
    """Waiting on ids that do not exist raises NotFound naming them."""
    await store.rollouts.enqueue_rollout("a", rollout_id="a")
    with pytest.raises(NotFound, match=r"rollouts \['nope'\] do not exist"):
        await store.finished.wait_for_rollouts(["a", "nope"], timeout_s=0)


@pytest.mark.parametrize("shards", [1, 3])
async def test_an_entry_for_an_unknown_rollout_is_dead_lettered_and_acknowledged(
    store: RedisStore, shards: int
) -> None:
    """`dead_letter_unknown` sets the entry aside with the reason, from its own shard's stream, and
    acknowledges it: the group's pending list is empty and its next read goes on."""
    store = RedisStore(store.redis, store.experiment, shards=shards)
    rid = next(f"ro-ghost{i}" for i in range(100) if store.keys.shard(f"ro-ghost{i}").index == shards - 1)
    stream = store.keys.shard(rid).finished
    await store.finished.ensure_finished_group("algorithm")
    await store.redis.xadd(stream, {"m": RolloutFinished(rid, RolloutStatus.SUCCEEDED, f"{rid}.1").to_wire()})
    (entry,) = await store.finished.read_finished("algorithm", "c1")
    await store.finished.dead_letter_unknown("algorithm", [entry])
    (letter,) = await store.dead_letters.query_dead_letters()
    assert letter.reason == f"finished entry for unknown rollout {rid}"
    assert letter.source == stream and RolloutFinished.from_wire(letter.payload["m"]).rollout_id == rid
    assert (await store.redis.xpending(stream, "algorithm"))["pending"] == 0
    assert await store.finished.read_finished("algorithm", "c1", pending=True) == []
