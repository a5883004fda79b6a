"""Smoke: the store claims a rollout on both backends."""

from fulmen.store import RedisStore


async def test_enqueue_then_claim(store: RedisStore) -> None:
    """An enqueued rollout is claimed by a worker with a first attempt."""
    await store.enqueue_rollout({"q": 1}, rollout_id="r1")
    claimed = await store.dequeue_rollouts("w1", 5)
    assert [c.rollout.rollout_id for c in claimed] == ["r1"]
    assert claimed[0].attempt.attempt_id == "r1.1"
