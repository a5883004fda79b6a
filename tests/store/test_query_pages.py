"""`query_rollouts` pages (`fulmen rollouts --offset`): a total order, enqueue-time ties broken on the id."""

from __future__ import annotations

import pytest

from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore

ROLLOUTS = 150  # more than a small set's listpack: the status sets iterate in hash order
PAGE = 7


@pytest.mark.parametrize("status", [None, [RolloutStatus.QUEUING, RolloutStatus.PREPARING]])
@pytest.mark.parametrize("descending", [True, False])
async def test_pages_of_equal_enqueue_times_cover_every_rollout_once(
    real_store: RedisStore, status: list[RolloutStatus] | None, descending: bool
) -> None:
    """Rollouts enqueued in one call share their shard's enqueue time: a listing orders them by (time, id),
    the same on every call, so pages by offset cover each rollout exactly once."""
    store = RedisStore(real_store.redis, real_store.experiment, shards=3)
    ids = [f"ro-{i:04d}-{(i * 7919) % 1000:03d}" for i in range(ROLLOUTS)]
    await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout({"i": i}, rollout_id=rid) for i, rid in enumerate(ids)])
    await store.queue.dequeue_rollouts("w", 5)  # a few in another status set
    listed = await store.rollouts.query_rollouts(status=status, descending=descending)
    assert len({r.enqueue_time for r in listed}) <= 3  # a clock read per shard: ~50 rollouts per time
    by_time_then_id = sorted(listed, key=lambda r: (r.enqueue_time, r.rollout_id), reverse=descending)
    assert [r.rollout_id for r in listed] == [r.rollout_id for r in by_time_then_id]
    assert sorted(r.rollout_id for r in listed) == sorted(ids)
    pages: list[str] = []
    for offset in range(0, ROLLOUTS, PAGE):
        page = await store.rollouts.query_rollouts(status=status, descending=descending, limit=PAGE, offset=offset)
        pages += [r.rollout_id for r in page]
    assert pages == [r.rollout_id for r in listed] and len(set(pages)) == ROLLOUTS
