"""What the crash tests of the embedded server (test_embedded_restart.py) and of a cluster node
(store/test_cluster_restart.py) share: rollouts moved through every state, a writer still enqueuing
when the server is killed two seconds after the snapshot, and the checks that all of it is back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from fulmen.records import AttemptedRollout
from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore

DURABLE_AFTER_S = 2.0  # appendfsync everysec: a write can be lost for up to 2 s, no longer


async def move_on(store: RedisStore, ids: list[str], *, claimed: int, running: int, succeeded: int,
                  cancelled: int) -> list[AttemptedRollout]:
    """``ids`` enqueued, then moved on: the first ``claimed`` dequeued (preparing), the first ``running``
    of those heartbeating, the first ``succeeded`` succeeded; the last ``cancelled`` ids cancelled.
    The claims."""
    await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout(i, rollout_id=i) for i in ids])
    claims = await store.queue.dequeue_rollouts("w1", claimed)
    assert len(claims) == claimed
    for c in claims[:running]:
        await store.spans.heartbeat(c.rollout.rollout_id, c.attempt.attempt_id)
    for c in claims[:succeeded]:
        await store.rollouts.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status="succeeded")
    for rid in ids[-cancelled:]:
        assert await store.rollouts.cancel_rollout(rid)
    return claims


async def kill_while_enqueuing(store: RedisStore, snapshot_at: float, kill: Callable[[], None],
                               errors: tuple[type[Exception], ...]) -> None:
    """``kill`` the server DURABLE_AFTER_S after ``snapshot_at`` (monotonic) while a writer is still
    enqueuing rollouts; the writer ends with ``errors`` (its connection died with the server)."""

    async def keep_enqueuing() -> None:
        for n in range(10_000):
            await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout(n, rollout_id=f"c{n:05d}-{i}") for i in range(5)])
            await asyncio.sleep(0.005)

    writer = asyncio.create_task(keep_enqueuing())
    await asyncio.sleep(snapshot_at + DURABLE_AFTER_S - time.monotonic())
    assert not writer.done()
    kill()
    writer.cancel()
    with contextlib.suppress(asyncio.CancelledError, *errors):
        await writer


async def assert_back_as_before(store: RedisStore, snapshot: dict[str, RolloutStatus],
                                later: dict[str, RolloutStatus]) -> None:
    """After the restart, every rollout of ``snapshot`` is there in the state it had then or the one
    ``later`` moved it to; the status indexes agree with the hashes; the queue hands out, once, exactly
    what is queuing."""
    after = {r.rollout_id: r.status for r in await store.rollouts.query_rollouts()}
    went_back = {
        rid: (status, after.get(rid))
        for rid, status in snapshot.items()
        if after.get(rid) not in {status, later.get(rid, status)}
    }
    assert went_back == {}
    # Nothing half-done: each status index holds exactly the rollouts whose hash says that status.
    index = {s: await store.redis.smembers(store.keys.status(s)) for s in RolloutStatus}
    assert index == {s: {rid.encode() for rid, status in after.items() if status is s} for s in RolloutStatus}
    # The queue's consumer group survived too: what is queuing is claimed, once, and nothing else.
    queuing = sorted(rid for rid, status in after.items() if status is RolloutStatus.QUEUING)
    reclaimed = []
    while batch := await store.queue.dequeue_rollouts("w3", 500):
        reclaimed += batch
    assert sorted(c.rollout.rollout_id for c in reclaimed) == queuing
    assert {c.attempt.attempt_id for c in reclaimed} == {f"{rid}.1" for rid in queuing}
