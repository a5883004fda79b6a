"""Joined script calls: calls of a joinable script on one key, made in the same loop iteration, go to
the server as one script call (unless a call of another script on that key comes between them), and
each caller still gets its own outcome."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis_cluster import store_url

from fulmen.errors import NotFound
from fulmen.records import Span
from fulmen.store import RedisStore
from fulmen.store.lua.scripts import joinable
from fulmen.store.redis.autopipeline import AutoPipeline
from fulmen.store.redis.embedded import EmbeddedRedis


@pytest.fixture(params=["single", "cluster", "cluster-3-shards"])
def redis_url(request: pytest.FixtureRequest) -> str:
    return store_url(request, request.param)


def _record_groups(pipeline: AutoPipeline) -> list[list[list[int]]]:
    """Per round trip, the positions (in the order they were made) of the calls each script call carried."""
    rounds: list[list[list[int]]] = []
    inner = pipeline._joins

    def joins(batch: Any) -> Any:
        calls, members = inner(batch)
        rounds.append(members)
        return calls, members

    pipeline._joins = joins  # type: ignore[method-assign]
    return rounds


def _span(attempt_id: str, span_id: str) -> Span:
    return Span(attempt_id.rpartition(".")[0], attempt_id, span_id, "llm")


async def test_concurrent_finishes_are_joined_and_each_gets_its_own_outcome(store: RedisStore) -> None:
    """Six finishes at once, each with another outcome: success with spans, a failure that is retried,
    spans of which one is stored already (sent again without it), an unknown attempt, a running
    report, a success without spans. They go out joined, and each caller sees what it would alone."""
    retry = {"max_attempts": 2, "retry_condition": ["failed"]}
    for i in range(6):
        await store.rollouts.enqueue_rollout({"i": i}, rollout_id=f"r{i}", config=retry if i == 1 else None)
    claimed = {c.rollout.rollout_id: c.attempt.attempt_id for c in await store.queue.dequeue_rollouts("w", 6)}
    assert len(claimed) == 6
    await store.spans.add_spans([_span(claimed["r2"], "s-old")])
    rounds = _record_groups(store.ctx.pipeline)

    outcomes = await asyncio.gather(
        store.rollouts.update_attempt("r0", claimed["r0"], status="succeeded", spans=[_span(claimed["r0"], "a"), _span(claimed["r0"], "b")]),
        store.rollouts.update_attempt("r1", claimed["r1"], status="failed", error="boom"),
        store.rollouts.update_attempt("r2", claimed["r2"], status="succeeded", spans=[_span(claimed["r2"], "s-old"), _span(claimed["r2"], "s-new")]),
        store.rollouts.update_attempt("r3", "r3.9", status="succeeded", spans=[_span("r3.9", "x")]),
        store.rollouts.update_attempt("r4", claimed["r4"], status="running"),
        store.rollouts.update_attempt("r5", claimed["r5"], status="succeeded", reward=0.5),
        return_exceptions=True,
    )

    assert outcomes[:3] == ["succeeded", "requeued", "succeeded"]
    assert isinstance(outcomes[3], NotFound)
    assert outcomes[4:] == ["running", "succeeded"]
    assert any(len(group) > 1 for groups in rounds for group in groups), rounds  # some calls really were joined
    statuses = {rid: (await store.rollouts.get_rollout(rid)).status for rid in claimed}
    assert statuses == {"r0": "succeeded", "r1": "requeuing", "r2": "succeeded", "r3": "preparing",
                        "r4": "running", "r5": "succeeded"}
    assert [s.span_id for s in await store.spans.query_spans("r0")] == ["a", "b"]
    assert [s.span_id for s in await store.spans.query_spans("r2")] == ["s-old", "s-new"]  # s-old once
    assert await store.spans.query_spans("r3") == []
    assert (await store.rollouts.get_rollout("r5")).reward == 0.5


@pytest.fixture
async def pipeline(redis_server: EmbeddedRedis) -> Any:
    client = aioredis.from_url(redis_server.url)
    yield AutoPipeline(client)
    await client.aclose()


async def test_joined_calls_keep_their_order_and_replies(pipeline: AutoPipeline, experiment: str) -> None:
    """Calls on one key are joined up to a call of another script on that key, so each runs after every
    call made before it on its key; calls on other keys may come between them; each call gets its own
    reply; a group larger than MAX_JOINED is split."""
    redis = pipeline.redis
    log, log2 = f"{experiment}:log", f"{experiment}:log2"
    push = "redis.call('RPUSH', KEYS[1], ARGV[1]) return ARGV[1] .. '/' .. #ARGV"
    one, joined = (redis.register_script(s) for s in joinable("", push))
    other = redis.register_script(push)  # not joinable
    pipeline.join(one, joined)
    rounds = _record_groups(pipeline)

    replies = await asyncio.gather(
        pipeline.submit(one, [log, "a", "extra"]), pipeline.submit(one, [log2, "d"]), pipeline.submit(one, [log, "b"]),
        pipeline.submit(other, [log, "x"]), pipeline.submit(one, [log, "c"]), pipeline.submit(one, [log2, "e"]),
    )
    assert replies == [b"a/2", b"d/1", b"b/1", b"x/1", b"c/1", b"e/1"]
    assert rounds == [[[0, 2], [1, 5], [3], [4]]]  # "x" closes log's group: "c" may not run before it
    assert await redis.lrange(log, 0, -1) == [b"a", b"b", b"x", b"c"]
    assert await redis.lrange(log2, 0, -1) == [b"d", b"e"]

    n = AutoPipeline.MAX_JOINED + 6
    replies = await asyncio.gather(*(pipeline.submit(one, [f"{log}3", str(i)]) for i in range(n)))
    assert replies == [f"{i}/1".encode() for i in range(n)]
    assert [len(group) for group in rounds[-1]] == [AutoPipeline.MAX_JOINED, 6]
    assert await redis.lrange(f"{log}3", 0, -1) == [str(i).encode() for i in range(n)]


async def test_an_error_in_a_joined_call_fails_that_call_only(pipeline: AutoPipeline, experiment: str) -> None:
    """Redis does not undo a failed script's writes: a call that fails inside a joined call gets its
    error, and the calls joined with it — before it, whose writes stand, and after it — their replies."""
    redis = pipeline.redis
    log = f"{experiment}:log"
    body = """redis.call('RPUSH', KEYS[1], ARGV[1])
if ARGV[1] == 'boom' then error('boom') end
if ARGV[1] == 'wrongtype' then redis.call('HSET', KEYS[1], 'f', 'v') end
if ARGV[1] == 'nil' then return nil end
return ARGV[1]"""
    one, joined = (redis.register_script(s) for s in joinable("", body))
    pipeline.join(one, joined)
    rounds = _record_groups(pipeline)

    replies = await asyncio.gather(
        *(pipeline.submit(one, [log, x]) for x in ("fine", "boom", "wrongtype", "nil", "after")),
        pipeline.submit(one, [f"{experiment}:other", "other"]), return_exceptions=True,
    )
    assert rounds == [[[0, 1, 2, 3, 4], [5]]]
    assert replies[0] == b"fine"
    assert isinstance(replies[1], ResponseError) and "boom" in str(replies[1])
    assert isinstance(replies[2], ResponseError) and "WRONGTYPE" in str(replies[2])
    assert replies[3:] == [None, b"after", b"other"]
    assert await redis.lrange(log, 0, -1) == [b"fine", b"boom", b"wrongtype", b"nil", b"after"]


async def test_a_server_that_lost_its_scripts_gets_them_all_again_and_calls_keep_their_order(
        redis_server: EmbeddedRedis, experiment: str) -> None:
    """After a restart (here SCRIPT FLUSH) every call of the next round trip finds its script missing:
    they are sent again in the order they were made, after the pipeline's ``reload`` loaded every
    script — also those this round trip did not use, so no later round trip finds only some loaded."""
    client = aioredis.from_url(redis_server.url)
    log = f"{experiment}:log"
    push = "redis.call('RPUSH', KEYS[1], ARGV[1]) return ARGV[1]"
    one, joined = (client.register_script(s) for s in joinable("", push))
    other, unused = client.register_script(push), client.register_script(push + " -- unused")

    async def reload() -> None:
        for script in (one, joined, other, unused):
            script.sha = await client.script_load(script.script)

    pipeline = AutoPipeline(client, reload=reload)
    pipeline.join(one, joined)
    try:
        await reload()
        await client.script_flush()
        replies = await asyncio.gather(pipeline.submit(one, [log, "a"]), pipeline.submit(one, [log, "b"]),
                                       pipeline.submit(other, [log, "x"]), pipeline.submit(one, [log, "c"]))
        assert replies == [b"a", b"b", b"x", b"c"]
        assert await client.lrange(log, 0, -1) == [b"a", b"b", b"x", b"c"]
        assert await client.script_exists(unused.sha) == [True]

        await client.script_flush()  # a call made alone reloads them all too
        assert await pipeline.submit(one, [log, "d"]) == b"d"
        assert await client.script_exists(unused.sha) == [True]
    finally:
        await client.aclose()
