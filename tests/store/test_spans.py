"""Spans: per-rollout sequence ids, deduplication, heartbeats, queries and size limits."""

from __future__ import annotations

import asyncio

import pytest

from fulmen.errors import NotFound, RecordTooLarge
from fulmen.records import Span
from fulmen.records.status import AttemptStatus, RolloutStatus
from fulmen.store import RedisStore


def _span(attempt_id: str, span_id: str, **kwargs: object) -> Span:
    return Span(attempt_id.rpartition(".")[0], attempt_id, span_id, kwargs.pop("name", "llm"), **kwargs)


async def _claim(store: RedisStore, rollout_id: str = "r1", **kwargs: object) -> str:
    await store.rollouts.enqueue_rollout("x", rollout_id=rollout_id, **kwargs)
    claimed = await store.queue.dequeue_rollout("w1")
    assert claimed is not None and claimed.rollout.rollout_id == rollout_id
    return claimed.attempt.attempt_id


def _seq(spans: list[Span]) -> list[tuple[int, str, str]]:
    return [(s.sequence_id, s.attempt_id, s.span_id) for s in spans]


async def test_sequence_ids_increase_across_calls_and_attempts(store: RedisStore) -> None:
    """Sequence ids count up per rollout across add_spans calls and across attempts."""
    await _claim(store, config={"max_attempts": 2, "retry_condition": ["failed"]})
    stored = await store.spans.add_spans([_span("r1.1", "a"), _span("r1.1", "b")])
    assert _seq(stored) == [(1, "r1.1", "a"), (2, "r1.1", "b")]
    one = await store.spans.add_span(_span("r1.1", "c"))
    assert one is not None and one.sequence_id == 3
    await store.rollouts.update_attempt("r1", "r1.1", status="failed")
    assert (await store.queue.dequeue_rollout("w2")).attempt.attempt_id == "r1.2"
    # Same span id, new attempt: a different span, so it is stored.
    assert _seq(await store.spans.add_spans([_span("r1.2", "a")])) == [(4, "r1.2", "a")]
    assert _seq(await store.spans.query_spans("r1")) == [
        (1, "r1.1", "a"),
        (2, "r1.1", "b"),
        (3, "r1.1", "c"),
        (4, "r1.2", "a"),
    ]


async def test_sequence_ids_are_per_rollout(store: RedisStore) -> None:
    """Each rollout numbers its spans from 1, whatever other rollouts store."""
    await _claim(store, "r1")
    await _claim(store, "r2")
    stored = await store.spans.add_spans([_span("r1.1", "a"), _span("r2.1", "a"), _span("r1.1", "b")])
    assert sorted(_seq(stored)) == [(1, "r1.1", "a"), (1, "r2.1", "a"), (2, "r1.1", "b")]
    assert _seq(await store.spans.query_spans("r2")) == [(1, "r2.1", "a")]


async def test_span_round_trips_every_field(store: RedisStore) -> None:
    """A stored span reads back equal, with its sequence id set."""
    aid = await _claim(store)
    span = _span(
        aid,
        "s1",
        name="chat.completions",
        trace_id="t" * 32,
        parent_id="p1",
        start_time=1.5,
        end_time=2.25,
        status_code="OK",
        status_message="fine",
        attributes={"gen_ai.usage.prompt_tokens": 12, "ids": [1, 2, 3], "raw": b"\x00\x01"},
        events=[{"name": "reward", "attributes": {"value": 0.5}}],
        links=[{"trace_id": "u", "span_id": "v"}],
        resource={"service.name": "agent"},
    )
    stored = await store.spans.add_span(span)
    assert stored is not None and stored.sequence_id == 1
    assert await store.spans.query_spans("r1") == [stored]
    assert stored.attributes == span.attributes and stored.events == span.events


async def test_duplicate_spans_are_ignored(store: RedisStore) -> None:
    """A span already stored (same attempt and span id) is ignored, within a call and across calls."""
    aid = await _claim(store)
    stored = await store.spans.add_spans([_span(aid, "a"), _span(aid, "a", name="again"), _span(aid, "b")])
    assert _seq(stored) == [(1, aid, "a"), (2, aid, "b")]
    assert await store.spans.add_span(_span(aid, "a", name="redelivered")) is None
    assert await store.spans.add_spans([_span(aid, "b"), _span(aid, "c")]) == [_span(aid, "c", sequence_id=3)]
    spans = await store.spans.query_spans("r1")
    assert _seq(spans) == [(1, aid, "a"), (2, aid, "b"), (3, aid, "c")]
    assert spans[0].name == "llm"  # the first write wins
    assert await store.redis.xlen(store.keys.spans("r1")) == 2  # one entry per call that stored any


async def test_span_is_a_heartbeat(store: RedisStore) -> None:
    """A span moves a preparing attempt to running and moves its heartbeat time forward."""
    aid = await _claim(store, config={"unresponsive_seconds": 30})
    before = await store.rollouts.get_attempt(aid)
    watched_before = await store.redis.zscore(store.keys.watch_heartbeat, aid)
    await asyncio.sleep(0.01)
    await store.spans.add_span(_span(aid, "a"))
    after = await store.rollouts.get_attempt(aid)
    assert (before.status, after.status) == (AttemptStatus.PREPARING, AttemptStatus.RUNNING)
    assert after.last_heartbeat_time > before.last_heartbeat_time
    assert await store.redis.zscore(store.keys.watch_heartbeat, aid) == pytest.approx(
        after.last_heartbeat_time + 30
    )
    assert await store.redis.zscore(store.keys.watch_heartbeat, aid) > watched_before
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.RUNNING
    await asyncio.sleep(0.01)
    assert await store.spans.add_span(_span(aid, "a")) is None  # a duplicate still counts as a heartbeat
    assert (await store.rollouts.get_attempt(aid)).last_heartbeat_time > after.last_heartbeat_time


async def test_late_span_on_ended_attempt_does_not_revive_it(store: RedisStore) -> None:
    """A span arriving after its attempt ended is stored but changes no status."""
    aid = await _claim(store)
    await store.rollouts.update_attempt("r1", aid, status="succeeded")
    stored = await store.spans.add_span(_span(aid, "late"))
    assert stored is not None and stored.sequence_id == 1
    assert (await store.rollouts.get_attempt(aid)).status is AttemptStatus.SUCCEEDED
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.SUCCEEDED


async def test_spans_for_unknown_attempt_raise_not_found(store: RedisStore) -> None:
    """Spans and heartbeats for an unknown attempt, or one of another rollout, raise NotFound."""
    await _claim(store, "r1")
    await _claim(store, "r2")
    with pytest.raises(NotFound, match=r"attempt r1\.9 of rollout r1 does not exist"):
        await store.spans.add_span(_span("r1.9", "a"))
    with pytest.raises(NotFound, match=r"attempt nope\.1 of rollout nope does not exist"):
        await store.spans.add_span(_span("nope.1", "a"))
    with pytest.raises(NotFound, match=r"attempt r2\.1 of rollout r1 does not exist"):
        await store.spans.add_span(Span("r1", "r2.1", "a", "llm"))
    with pytest.raises(NotFound, match=r"attempt r1\.9 of rollout r1 does not exist"):
        await store.spans.heartbeat("r1", "r1.9")
    assert await store.spans.query_spans("r1") == []
    assert await store.spans.query_spans("r2") == []
    assert (await store.rollouts.get_attempt("r2.1")).status is AttemptStatus.PREPARING


async def test_query_spans_filters(store: RedisStore) -> None:
    """query_spans filters by attempt ('latest' included), after a sequence id, and limits."""
    await _claim(store, config={"max_attempts": 2, "retry_condition": ["failed"]})
    await store.spans.add_spans([_span("r1.1", x) for x in "abc"])
    await store.rollouts.update_attempt("r1", "r1.1", status="failed")
    await store.queue.dequeue_rollout("w1")
    await store.spans.add_spans([_span("r1.2", x) for x in "de"])

    assert [s.span_id for s in await store.spans.query_spans("r1")] == list("abcde")
    assert [s.span_id for s in await store.spans.query_spans("r1", "r1.1")] == list("abc")
    assert [s.span_id for s in await store.spans.query_spans("r1", "r1.2")] == list("de")
    assert [s.span_id for s in await store.spans.query_spans("r1", "latest")] == list("de")
    assert [s.sequence_id for s in await store.spans.query_spans("r1", after_sequence_id=2)] == [3, 4, 5]
    assert [s.sequence_id for s in await store.spans.query_spans("r1", after_sequence_id=5)] == []
    assert [s.sequence_id for s in await store.spans.query_spans("r1", limit=2)] == [1, 2]
    assert [s.sequence_id for s in await store.spans.query_spans("r1", "r1.2", limit=1)] == [4]
    assert [s.sequence_id for s in await store.spans.query_spans("r1", "r1.1", after_sequence_id=1, limit=1)] == [2]
    assert [s.sequence_id for s in await store.spans.query_spans("r1", "latest", after_sequence_id=4)] == [5]
    assert await store.spans.query_spans("r1", "r1.9") == []
    await store.spans.add_spans([_span("r1.2", "f", name="reward")])
    assert [s.span_id for s in await store.spans.query_spans("r1", name="reward")] == ["f"]
    assert [s.span_id for s in await store.spans.query_spans("r1", "r1.1", name="reward")] == []
    assert await store.spans.query_spans("other") == []
    with pytest.raises(NotFound, match="rollout other does not exist"):
        await store.spans.query_spans("other", "latest")


async def test_oversize_span_raises_record_too_large(store: RedisStore) -> None:
    """A span over max_record_bytes is refused before anything is written."""
    small = RedisStore(store.redis, store.experiment, max_record_bytes=1024)
    aid = await _claim(small)
    with pytest.raises(RecordTooLarge, match="over the 1,024-byte limit"):
        await small.spans.add_span(_span(aid, "big", attributes={"text": "x" * 2000}))
    assert await small.spans.query_spans("r1") == []
    assert (await small.rollouts.get_attempt(aid)).status is AttemptStatus.PREPARING
    stored = await small.spans.add_span(_span(aid, "ok", attributes={"text": "x" * 100}))
    assert stored is not None and stored.sequence_id == 1


async def test_oversize_rollout_input_raises_record_too_large(store: RedisStore) -> None:
    """A rollout whose input is over max_record_bytes is not enqueued."""
    small = RedisStore(store.redis, store.experiment, max_record_bytes=1024)
    with pytest.raises(RecordTooLarge):
        await small.rollouts.enqueue_rollout("x" * 2000, rollout_id="r1")
    assert await small.rollouts.get_rollouts(["r1"]) == [None]
    assert await small.redis.xlen(small.keys.queue) == 0


async def test_finishing_with_spans_stores_them_in_the_same_step(store: RedisStore) -> None:
    """update_attempt(spans=...) stores the last spans (deduplicated, in order) and ends the attempt."""
    await _claim(store)
    await store.spans.add_spans([_span("r1.1", "a")])
    result = await store.rollouts.update_attempt(
        "r1", "r1.1", status="succeeded", spans=[_span("r1.1", "a"), _span("r1.1", "b"), _span("r1.1", "c")]
    )
    assert result == "succeeded"
    assert _seq(await store.spans.query_spans("r1")) == [(1, "r1.1", "a"), (2, "r1.1", "b"), (3, "r1.1", "c")]
    assert (await store.rollouts.get_rollout("r1")).status is RolloutStatus.SUCCEEDED


async def test_finishing_with_spans_refuses_foreign_spans_and_unknown_attempts(store: RedisStore) -> None:
    """A span of another attempt is refused before anything is written; an unknown attempt is NotFound."""
    from fulmen.errors import InvalidInput

    await _claim(store)
    with pytest.raises(InvalidInput, match="belongs to attempt"):
        await store.rollouts.update_attempt("r1", "r1.1", status="succeeded", spans=[_span("r9.1", "a")])
    assert (await store.rollouts.get_attempt("r1.1")).status is AttemptStatus.PREPARING
    with pytest.raises(NotFound):
        await store.rollouts.update_attempt("r1", "r1.7", status="succeeded", spans=[_span("r1.7", "a")])
    assert await store.spans.query_spans("r1") == []


async def test_a_late_finish_with_spans_numbers_them_on_from_the_counter(store: RedisStore) -> None:
    """A repeated finish (the attempt has ended: 'already') still stores its new spans, once each even
    when a call repeats one, numbered on from the rollout's counter, which it moves on for later spans."""
    await _claim(store)
    assert await store.rollouts.update_attempt("r1", "r1.1", status="succeeded", spans=[_span("r1.1", "a")]) == "succeeded"
    late = [_span("r1.1", "b"), _span("r1.1", "b", name="again"), _span("r1.1", "a")]
    assert await store.rollouts.update_attempt("r1", "r1.1", status="succeeded", spans=late) == "already"
    assert await store.spans.add_spans([_span("r1.1", "c")]) == [_span("r1.1", "c", sequence_id=3)]
    spans = await store.spans.query_spans("r1")
    assert _seq(spans) == [(1, "r1.1", "a"), (2, "r1.1", "b"), (3, "r1.1", "c")]
    assert spans[1].name == "llm"


async def test_a_call_is_one_entry_and_reads_as_its_spans_old_entries_included(store: RedisStore) -> None:
    """The spans one call stores are one stream entry of one field (a compressed batch), read back as
    the same Span records with their own sequence ids, by query_spans and by the adapter's `SpanView`
    reader, next to entries in the forms older stores wrote: one span per entry (``m``) and one call
    per entry in one field per span (``m``, ``m1``, ...)."""
    from fulmen.records import SpanView

    aid = await _claim(store)
    old = _span(aid, "old", name="before")  # one span per entry: id "<seq>-0", m
    await store.redis.xadd(store.keys.spans("r1"), {"m": old.to_wire()}, id="1-0")
    older_call = [_span(aid, "o1", name="call"), _span(aid, "o2", name="call")]  # a call, a field per span
    await store.redis.xadd(store.keys.spans("r1"), {"m": older_call[0].to_wire(), "m1": older_call[1].to_wire()},
                           id="3-0")
    await store.redis.hset(store.keys.rollout("r1"), "seq", 3)
    many = [_span(aid, f"s{i}", attributes={"i": i, "text": "the same prompt again " * 20}) for i in range(1203)]
    stored = await store.spans.add_spans(many)
    assert [s.sequence_id for s in stored] == list(range(4, 1207))
    entries = await store.redis.xrange(store.keys.spans("r1"))
    assert [(eid, list(f)) for eid, f in entries][2:] == [(b"1206-0", [b"z"])]  # the call: one entry, one field
    assert len(entries[2][1][b"z"]) < sum(len(s.to_wire()) for s in many) / 10  # compressed
    spans = await store.spans.query_spans("r1")
    assert spans[3:] == stored
    assert [(s.span_id, s.name, s.sequence_id) for s in spans[:3]] == [
        ("old", "before", 1), ("o1", "call", 2), ("o2", "call", 3)]
    assert [s.sequence_id for s in await store.spans.query_spans("r1", after_sequence_id=1000, limit=3)] == [1001, 1002, 1003]
    expected = [(s.sequence_id, s.span_id, s.attributes) for s in spans]
    for shape in (entries, [[eid, [x for kv in f.items() for x in kv]] for eid, f in entries]):  # parsed, raw
        assert [(v.sequence_id, v.span_id, v.attributes) for v in SpanView.from_entries(shape)] == expected


async def test_a_batch_that_is_not_one_or_inflates_too_far_is_a_record_error(store: RedisStore) -> None:
    """An entry whose batch field is neither zstd nor zlib, not an array of records, or inflates past the bound
    reads as RecordError (the adapter dead-letters it), never a crash or an unbounded allocation."""
    import zlib

    import msgpack

    from fulmen.errors import RecordError
    from fulmen.records import SpanView
    from fulmen.records.spans import pack_span_batch, unpack_span_batch

    assert unpack_span_batch(pack_span_batch([b"a", b"bc"])) == [b"a", b"bc"]
    for bad in (b"not zlib", zlib.compress(b"\xc1"), zlib.compress(msgpack.packb([1, 2])), zlib.compress(msgpack.packb({}))):
        with pytest.raises(RecordError):
            unpack_span_batch(bad)
        with pytest.raises(RecordError):
            SpanView.from_entries([[b"2-0", [b"z", bad]]])
    with pytest.raises(RecordTooLarge, match="inflates"):
        unpack_span_batch(zlib.compress(b"\0" * 10_000), max_bytes=1000)
    # zstd, as written today: a frame that declares a size over the bound is refused before any
    # allocation, one that declares none stops at the bound; a damaged frame is a RecordError
    import zstandard

    assert pack_span_batch([b"a"])[:4] == b"\x28\xb5\x2f\xfd"
    with pytest.raises(RecordTooLarge, match="inflates"):
        unpack_span_batch(zstandard.ZstdCompressor().compress(msgpack.packb([b"\0" * 10_000])), max_bytes=1000)
    undeclared = zstandard.ZstdCompressor(write_content_size=False).compress(msgpack.packb([b"\0" * 10_000]))
    with pytest.raises(RecordError, match="within 1,000 bytes"):
        unpack_span_batch(undeclared, max_bytes=1000)
    assert unpack_span_batch(undeclared) == [b"\0" * 10_000]
    for bad in (pack_span_batch([b"a", b"bc"])[:-2], b"\x28\xb5\x2f\xfd" + b"\xff" * 20):
        with pytest.raises(RecordError):
            unpack_span_batch(bad)
    # batches written as zlib before are read as they were
    assert unpack_span_batch(zlib.compress(msgpack.packb([b"a", b"bc"]), 1)) == [b"a", b"bc"]


async def test_dedupe_keys_are_64_bit_integers_so_a_rollouts_set_is_an_intset(store: RedisStore) -> None:
    """The store remembers a stored span by a 64-bit hash of its attempt and span id: the same span
    gives the same key, other spans others, and a rollout's set of them is Redis's compact intset."""
    from fulmen.store.spans import dedupe_key

    keys = {dedupe_key(_span(f"r{r}.{a}", f"s{i}")) for r in range(3) for a in (1, 2) for i in range(200)}
    assert len(keys) == 1200 and all(-(2**63) <= int(k) < 2**63 for k in keys)
    assert dedupe_key(_span("r1.1", "a")) == dedupe_key(_span("r1.1", "a", name="other"))
    aid = await _claim(store)
    assert len(await store.spans.add_spans([_span(aid, f"s{i}") for i in range(20)])) == 20
    assert await store.redis.object("encoding", store.keys.span_ids("r1")) == b"intset"
    assert await store.spans.add_spans([_span(aid, "s3"), _span(aid, "s20")]) == [_span(aid, "s20", sequence_id=21)]


async def test_record_spans_stores_as_add_spans_does_and_counts(store: RedisStore) -> None:
    """`record_spans` stores what `add_spans` would (repeats dropped, sequence ids given) and says how many."""
    await store.rollouts.enqueue_rollout({"i": 1}, rollout_id="rr")
    (c,) = await store.queue.dequeue_rollouts("w", 1)
    aid = c.attempt.attempt_id
    assert await store.spans.record_spans([_span(aid, "a"), _span(aid, "b"), _span(aid, "a")]) == 2
    assert await store.spans.record_spans([_span(aid, "b"), _span(aid, "c")]) == 1  # b stored already
    assert [(s.sequence_id, s.span_id) for s in await store.spans.query_spans("rr")] == [(1, "a"), (2, "b"), (3, "c")]
