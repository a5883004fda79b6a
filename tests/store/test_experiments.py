"""Experiments are listed and deleted as a whole."""

from __future__ import annotations

import uuid

from fulmen.store import RedisStore
from fulmen.store.experiments import delete_experiment, list_experiments


async def test_list_and_delete(store: RedisStore) -> None:
    """Deleting one experiment removes all its keys and leaves the other intact."""
    other = RedisStore(store.redis, f"o-{uuid.uuid4().hex[:8]}")
    await store.rollouts.enqueue_rollout({"x": 1}, rollout_id="a")
    await other.rollouts.enqueue_rollout({"x": 2}, rollout_id="a")
    assert {store.experiment, other.experiment} <= set(await list_experiments(store.redis))

    deleted = await delete_experiment(store.redis, store.experiment)

    assert deleted >= 3  # rollout hash, queue, index, status set
    assert await store.redis.keys(store.keys.pattern()) == []
    assert store.experiment not in await list_experiments(store.redis)
    assert (await other.rollouts.get_rollout("a")).input == {"x": 2}
