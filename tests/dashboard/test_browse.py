"""`fulmen.store.browse`: pages newest first from a cursor, bounded work per page, the status-set path."""

from __future__ import annotations

from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.browse import RolloutFilter, browse_rollouts


async def _all_pages(store: RedisStore, where: RolloutFilter, limit: int, budget: int = 2000) -> list[str]:
    seen, cursor = [], None
    while True:
        page = await browse_rollouts(store.redis, store.keys, where, limit=limit, cursor=cursor, scan_budget=budget)
        assert page.scanned <= budget
        seen += [r.rollout_id for r in page.rows]
        if page.next_cursor is None:
            return seen
        cursor = page.next_cursor


async def test_pages_cover_every_rollout_once_newest_first(real_store: RedisStore) -> None:
    """Paging on from each cursor lists every rollout once, newest first, with or without a status filter."""
    ids = [f"r-{i:02d}" for i in range(23)]
    for rid in ids:
        await real_store.rollouts.enqueue_rollout({"i": rid}, rollout_id=rid)
    assert await _all_pages(real_store, RolloutFilter(), limit=5) == list(reversed(ids))
    queued = RolloutFilter(statuses=frozenset({RolloutStatus.QUEUING}))
    assert await _all_pages(real_store, queued, limit=4) == list(reversed(ids))


async def test_a_filter_that_matches_little_looks_a_bounded_number_of_entries(real_store: RedisStore) -> None:
    """With a scan budget of 7, each page reads at most 7 index entries and hands on a cursor."""
    for i in range(20):
        await real_store.rollouts.enqueue_rollout({"i": i}, rollout_id=f"r-{i:02d}", mode="val" if i == 3 else "train")
    page = await browse_rollouts(real_store.redis, real_store.keys, RolloutFilter(mode="val"), limit=5, scan_budget=7)
    assert page.rows == [] and page.scanned == 7 and page.next_cursor is not None
    assert await _all_pages(real_store, RolloutFilter(mode="val"), limit=5, budget=7) == ["r-03"]
