"""A rollout's hash is created without its empty optional fields; every reader sees their defaults."""

from __future__ import annotations

from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.browse import RolloutFilter, browse_rollouts


async def test_empty_optional_fields_are_not_stored_and_read_as_their_defaults(store: RedisStore) -> None:
    rollout = await store.rollouts.enqueue_rollout({"q": 1}, rollout_id="r1")
    raw = await store.redis.hgetall(store.keys.rollout("r1"))
    assert not {b"mode", b"resources_id", b"end_time", b"reward"} & set(raw)
    assert (raw[b"status"], raw[b"attempt_n"]) == (b"queuing", b"0") and float(raw[b"enqueue_time"]) > 0
    assert (rollout.mode, rollout.resources_id, rollout.end_time, rollout.reward) == (None, None, None, None)
    assert await store.rollouts.get_rollout("r1") == rollout
    page = await browse_rollouts(store.redis, store.keys, RolloutFilter())
    assert [(r.rollout_id, r.mode, r.reward, r.end_time) for r in page.rows] == [("r1", None, None, None)]
    (row,) = await store.samples.read_for_samples(["r1"])
    assert row is not None and (row.mode, row.reward) == (None, None)

    claimed = await store.queue.dequeue_rollout("w1")
    assert claimed is not None
    assert await store.rollouts.update_attempt("r1", claimed.attempt.attempt_id, status="succeeded", reward=0.5) == "succeeded"
    done = await store.rollouts.get_rollout("r1")
    assert (done.status, done.reward, done.mode) == (RolloutStatus.SUCCEEDED, 0.5, None)
    assert done.end_time is not None and done.start_time is not None
