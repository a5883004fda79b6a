"""The span writer: a span the store refuses (over the record size limit) leaves a `fulmen.dropped` span
in its place on the attempt and a dead letter; the attempt's other spans are all stored."""

from __future__ import annotations

import asyncio
from typing import Any

import fulmen
from fulmen.records import RolloutStatus, Span
from fulmen.settings import RunnerSettings
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.telemetry.semconv import (
    DROPPED_LIMIT_BYTES,
    DROPPED_NAME,
    DROPPED_REASON,
    DROPPED_SIZE_BYTES,
    DROPPED_SPAN,
)
from fulmen.telemetry.tracing import SpanBuffer, setup_tracing
from fulmen_runner.runner import Runner
from fulmen_runner.span_writer import SpanWriter

LIMIT = 64 * 1024  # the store's record size limit in these tests: small, so an oversize span is cheap


def _small_store(store: RedisStore) -> RedisStore:
    return RedisStore(store.redis, store.experiment, max_record_bytes=LIMIT)


@fulmen.rollout
async def emits_an_oversize_object(task: Any) -> float:
    """A message, an object three times the store's limit, a message; reward 1.0."""
    fulmen.emit_message("before")
    fulmen.emit_object({"blob": "x" * 3 * LIMIT})
    fulmen.emit_message("after")
    return 1.0


async def test_an_oversize_span_is_replaced_by_a_dropped_span_and_a_dead_letter(real_store: RedisStore) -> None:
    """The marker takes the dropped span's id, trace and parent and says its name, size, the limit and
    why; the dead letter names the attempt; the spans beside it in the batch are stored."""
    store = _small_store(real_store)
    claimed = await store.rollouts.start_rollout("task", "w1")
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    root = Span(rid, aid, "root", semconv.ROLLOUT_SPAN, trace_id="t1", start_time=1.0, end_time=5.0)
    big = Span(rid, aid, "big", semconv.OBJECT_SPAN, trace_id="t1", parent_id="root", start_time=2.0,
               end_time=2.0, attributes={semconv.OBJECT_JSON: "x" * 3 * LIMIT})
    after = Span(rid, aid, "after", semconv.MESSAGE_SPAN, trace_id="t1", parent_id="root", start_time=3.0,
                 end_time=3.0, attributes={semconv.MESSAGE: "after"})
    writer = SpanWriter(store, SpanBuffer())
    await writer.write([root, big, after])

    spans = {s.span_id: s for s in await store.spans.query_spans(rid)}
    assert {i: s.name for i, s in spans.items()} == {
        "root": semconv.ROLLOUT_SPAN, "big": DROPPED_SPAN, "after": semconv.MESSAGE_SPAN,
    }
    marker = spans["big"]
    assert (marker.attempt_id, marker.trace_id, marker.parent_id) == (aid, "t1", "root")
    assert marker.attributes[DROPPED_NAME] == semconv.OBJECT_SPAN
    assert marker.attributes[DROPPED_SIZE_BYTES] == len(big.to_wire(10 * LIMIT)) > LIMIT
    assert marker.attributes[DROPPED_LIMIT_BYTES] == LIMIT
    assert "over the" in marker.attributes[DROPPED_REASON]
    (letter,) = await store.dead_letters.query_dead_letters()
    assert (letter.source, letter.entry_id) == (store.keys.spans(rid), f"{aid}/big")
    assert f"attempt {aid}" in letter.reason and semconv.OBJECT_SPAN in letter.reason
    assert (writer.written, writer.dropped) == (2, 1)


async def test_an_attempt_with_an_oversize_object_succeeds_with_the_drop_on_its_rollout(
    real_store: RedisStore,
) -> None:
    """A runner attempt whose agent emits an object over the limit: it succeeds with its reward, and the
    rollout's spans hold every other span and a `fulmen.dropped` span under the attempt's root."""
    store = _small_store(real_store)
    rid = (await store.rollouts.enqueue_rollout("task")).rollout_id
    _, buffer = setup_tracing("test-runner", set_global=False)
    runner = Runner(store, emits_an_oversize_object, buffer, RunnerSettings())
    task = asyncio.create_task(runner.run())
    try:
        (done,) = await store.finished.wait_for_rollouts([rid], timeout_s=20)
    finally:
        runner.stop()
        await asyncio.wait_for(task, timeout=runner.grace_s + 10)
    assert done.status is RolloutStatus.SUCCEEDED

    spans = await store.spans.query_spans(rid)
    assert sorted(s.name for s in spans) == sorted([
        semconv.MESSAGE_SPAN, DROPPED_SPAN, semconv.MESSAGE_SPAN, semconv.ROLLOUT_SPAN, semconv.REWARD_SPAN,
    ])
    assert {s.attempt_id for s in spans} == {done.attempt_id}
    (root,) = [s for s in spans if s.name == semconv.ROLLOUT_SPAN]
    (marker,) = [s for s in spans if s.name == DROPPED_SPAN]
    assert (marker.trace_id, marker.parent_id) == (root.trace_id, root.span_id)
    assert marker.attributes[DROPPED_NAME] == semconv.OBJECT_SPAN
    assert marker.attributes[DROPPED_SIZE_BYTES] > 3 * LIMIT
    assert marker.attributes[DROPPED_LIMIT_BYTES] == LIMIT
    (letter,) = await store.dead_letters.query_dead_letters()
    assert f"attempt {done.attempt_id}" in letter.reason
    assert letter.entry_id == f"{done.attempt_id}/{marker.span_id}"
