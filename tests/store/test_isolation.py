"""Two experiments on one Redis see nothing of each other."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from fulmen import keys as k
from fulmen.errors import NotFound
from fulmen.records import Span
from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore


@pytest.fixture
async def other(store: RedisStore) -> AsyncIterator[RedisStore]:
    """A second experiment on the same Redis connection as ``store``."""
    yield RedisStore(store.redis, store.experiment + "-b")


async def _keys(store: RedisStore) -> set[bytes]:
    return {key async for key in store.redis.scan_iter(match=store.keys.pattern())}


async def test_queue_is_per_experiment(store: RedisStore, other: RedisStore) -> None:
    """A rollout enqueued in one experiment is neither visible nor claimable in the other."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1")
    assert await other.queue.dequeue_rollouts("w1", count=10) == []
    with pytest.raises(NotFound, match=f"rollout r1 does not exist in experiment {other.experiment}"):
        await other.rollouts.get_rollout("r1")
    assert await other.rollouts.query_rollouts() == []
    claimed = await store.queue.dequeue_rollouts("w1", count=10)
    assert [c.rollout.rollout_id for c in claimed] == ["r1"]


async def test_same_rollout_id_in_two_experiments(store: RedisStore, other: RedisStore) -> None:
    """The same rollout id names two independent rollouts in two experiments."""
    await store.rollouts.enqueue_rollout({"exp": "a"}, rollout_id="r1")
    assert (await other.rollouts.enqueue_rollout({"exp": "b"}, rollout_id="r1")).input == {"exp": "b"}
    a = await store.queue.dequeue_rollout("wa")
    assert a is not None and a.rollout.input == {"exp": "a"}
    await store.rollouts.update_attempt("r1", "r1.1", status="succeeded")
    assert (await other.rollouts.get_rollout("r1")).status is RolloutStatus.QUEUING
    b = await other.queue.dequeue_rollout("wb")
    assert b is not None and (b.rollout.input, b.attempt.attempt_id) == ({"exp": "b"}, "r1.1")
    assert await other.rollouts.cancel_rollout("r1") is True
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.SUCCEEDED


async def test_statistics_are_per_experiment(store: RedisStore, other: RedisStore) -> None:
    """Statistics count only the experiment's own rollouts, finished entries and dead letters."""
    for rid in ["a", "b", "c"]:
        await store.rollouts.enqueue_rollout(rid, rollout_id=rid)
    await store.rollouts.cancel_rollout("a")
    await store.queue.ensure()
    await store.redis.xadd(store.keys.queue, {b"m": b"\xc1"})
    await store.queue.dequeue_rollouts("w1", count=10)
    await other.rollouts.enqueue_rollout("z", rollout_id="z")

    mine, theirs = await store.statistics(), await other.statistics()
    assert mine["rollouts"] == {
        "queuing": 0,
        "preparing": 2,
        "running": 0,
        "requeuing": 0,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 1,
    }
    assert (mine["total_rollouts"], mine["finished"], mine["dead_letters"]) == (3, 1, 1)
    assert mine["pending"] == {"w1": 0}
    assert theirs["rollouts"]["queuing"] == 1
    assert (theirs["total_rollouts"], theirs["finished"], theirs["dead_letters"]) == (1, 0, 0)
    assert theirs["pending"] == {}
    assert (mine["experiment"], theirs["experiment"]) == (store.experiment, other.experiment)


async def test_spans_are_per_experiment(store: RedisStore, other: RedisStore) -> None:
    """Spans and their sequence ids are separate per experiment, even for the same rollout id."""
    for s in (store, other):
        await s.rollouts.enqueue_rollout("x", rollout_id="r1")
        await s.queue.dequeue_rollout("w1")
    await store.spans.add_spans([Span("r1", "r1.1", n, "llm") for n in ["a", "b"]])
    assert await other.spans.query_spans("r1") == []
    stored = await other.spans.add_span(Span("r1", "r1.1", "a", "llm"))  # not a duplicate: other experiment
    assert stored is not None and stored.sequence_id == 1
    assert [s.span_id for s in await store.spans.query_spans("r1")] == ["a", "b"]


async def test_resources_are_per_experiment(store: RedisStore, other: RedisStore) -> None:
    """Resources, their versions and 'latest' are separate per experiment."""
    await store.resources.add_resources({"p": 1}, "main")
    await store.resources.update_resources("main", {"p": 2})
    assert await other.resources.get_latest_resources() is None
    assert await other.resources.query_resources() == []
    with pytest.raises(NotFound):
        await other.resources.get_resources("main")
    theirs = await other.resources.add_resources({"p": "b"}, "main")  # the same id is free there
    assert theirs.version == 1
    assert (await store.resources.get_latest_resources()).version == 2


async def test_completions_and_dead_letters_are_per_experiment(store: RedisStore, other: RedisStore) -> None:
    """A finished entry or dead letter in one experiment never shows in the other."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1")
    await store.rollouts.cancel_rollout("r1")
    await store.queue.ensure()
    await store.redis.xadd(store.keys.queue, {b"junk": b"1"})
    await store.queue.dequeue_rollouts("w1", count=10)
    assert await other.finished.read_finished("adapter", "c1") == []
    assert await other.dead_letters.query_dead_letters() == []
    assert [c.rollout_id for c in await store.finished.read_finished("adapter", "c1")] == ["r1"]
    assert len(await store.dead_letters.query_dead_letters()) == 1


async def test_keys_stay_inside_the_experiment_prefix(store: RedisStore, other: RedisStore) -> None:
    """Every key an experiment writes carries its own prefix; both are registered as experiments."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1")
    await store.queue.dequeue_rollout("w1")
    await store.spans.add_span(Span("r1", "r1.1", "a", "llm"))
    await store.resources.add_resources({"p": 1})
    await other.rollouts.enqueue_rollout("x", rollout_id="r1")
    mine, theirs = await _keys(store), await _keys(other)
    assert mine and theirs and not mine & theirs
    assert all(key.decode().startswith(store.keys.prefix) for key in mine)
    assert all(key.decode().startswith(other.keys.prefix) for key in theirs)
    experiments = await store.redis.smembers(k.EXPERIMENTS)
    assert {store.experiment.encode(), other.experiment.encode()} <= experiments
