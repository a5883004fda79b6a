"""The adapter's bulk read (`Samples.read_for_samples`): on the auto-pipeline's wire where it can go,
through the client where it cannot, with the same answer either way."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from fulmen.records import Span
from fulmen.store import RedisStore


async def _finished(store: RedisStore, n: int) -> list[str]:
    ids = [f"r{i}" for i in range(n)]
    for rid in ids:
        await store.rollouts.enqueue_rollout({"task": rid}, rollout_id=rid, metadata={"group_key": "g"})
    for claimed in await store.queue.dequeue_rollouts("w", n):
        rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
        await store.spans.add_spans([Span(rid, aid, "s1", "llm"), Span(rid, aid, "s2", "reward", parent_id="s1")])
        if rid != "r1":  # r1 stays running: no spans are read for it
            await store.rollouts.update_attempt(rid, aid, status="succeeded", reward=0.5)
    return ids


def _view(rows: list[Any]) -> list[Any]:
    return [None if r is None else (r.rollout_id, r.status, r.attempt_id, r.mode, r.metadata, r.reward,
                                    [(s.span_id, s.parent_id, s.name, s.sequence_id) for s in r.spans])
            for r in rows]


async def test_the_read_goes_on_the_wire_and_answers_as_through_the_client(
        store: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [*await _finished(store, 3), "gone"]
    answered: list[bool] = []  # per read on the wire: whether the wire carried it
    real = store.ctx.pipeline.on_wire

    async def spy(commands: Any) -> Any:
        replies = await real(commands)
        answered.append(replies is not None)
        return replies

    monkeypatch.setattr(store.ctx.pipeline, "on_wire", spy)
    on_wire = await store.samples.read_for_samples(ids)
    # a cluster's client routes each call itself: no wire there
    assert answered == ([] if isinstance(store.redis, RedisCluster) else [True])
    view = _view(on_wire)
    assert view[0] == ("r0", "succeeded", "r0.1", None, {"group_key": "g"}, 0.5, [("s1", None, "llm", 1),
                                                                                 ("s2", "s1", "reward", 2)])
    assert view[1][:2] == ("r1", "running") and view[1][-1] == [] and view[3] is None

    async def no_wire(commands: Any) -> None:
        return None

    monkeypatch.setattr(store.ctx.pipeline, "on_wire", no_wire)
    assert _view(await store.samples.read_for_samples(ids)) == view


async def test_a_server_that_lost_its_scripts_is_read_all_the_same(store: RedisStore) -> None:
    """NOSCRIPT inside the read's transaction (on the wire or not): the script is loaded again and
    the read made again."""
    ids = await _finished(store, 2)
    before = _view(await store.samples.read_for_samples(ids))
    if isinstance(store.redis, RedisCluster):
        await store.redis.execute_command("SCRIPT FLUSH", target_nodes=RedisCluster.ALL_NODES)
    else:
        await store.redis.script_flush()
    assert _view(await store.samples.read_for_samples(ids)) == before
