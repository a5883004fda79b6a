"""Poison messages go to the dead-letter stream with a reason and never block their stream; records
of an unknown schema version are refused by every decoder."""

from __future__ import annotations

import msgpack
import pytest

from fulmen import codec
from fulmen import keys as k
from fulmen.errors import InvalidInput, RecordError, RecordTooLarge, SchemaVersionError
from fulmen.records import (
    Attempt,
    DeadLetter,
    QueueEntry,
    ResourcesUpdate,
    Rollout,
    RolloutFinished,
    Span,
    Worker,
)
from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore

POISON_QUEUE_ENTRIES = [
    pytest.param({b"m": b"\xc1garbage"}, "not a valid msgpack record", id="garbage"),
    pytest.param({b"x": b"1"}, "queue entry has no 'm' field", id="no-m-field"),
    pytest.param(
        {b"m": msgpack.packb({"v": 99, "kind": "queue", "rollout_id": "x"})},
        "queue record has schema version 99",
        id="schema-99",
    ),
    pytest.param({b"m": msgpack.packb([1, 2])}, "a queue record must be a map, got list", id="not-a-map"),
    pytest.param(
        {b"m": codec.pack_record("rollout_finished", {"rollout_id": "x"})},
        "expected a queue record, got kind 'rollout_finished'",
        id="wrong-kind",
    ),
    pytest.param(
        {b"m": codec.pack_record("queue", {})}, "queue record has no 'rollout_id'", id="no-rollout-id"
    ),
    pytest.param({b"m": QueueEntry("ghost").to_wire()}, "rollout ghost does not exist", id="no-such-rollout"),
]


async def _queue_pending(store: RedisStore) -> int:
    return (await store.redis.xpending(store.keys.queue, k.RUNNERS_GROUP))["pending"]


def _payload(fields: dict[bytes, bytes]) -> dict[str, bytes]:
    return {name.decode(): value for name, value in fields.items()}


@pytest.mark.parametrize(("fields", "reason"), POISON_QUEUE_ENTRIES)
async def test_poison_queue_entry_is_dead_lettered(store: RedisStore, fields: dict, reason: str) -> None:
    """A malformed queue entry is dead-lettered with the reason and acked; the same call claims on."""
    await store.queue.ensure()
    poison_id = (await store.redis.xadd(store.keys.queue, fields)).decode()
    await store.rollouts.enqueue_rollout("x", rollout_id="good")

    claimed = await store.queue.dequeue_rollouts("w1", count=1)  # non-blocking, yet not stopped by poison
    assert [c.rollout.rollout_id for c in claimed] == ["good"]
    assert await store.queue.dequeue_rollouts("w1", count=1) == []

    letters = await store.dead_letters.query_dead_letters()
    assert len(letters) == 1
    letter = letters[0]
    assert (letter.source, letter.entry_id) == (store.keys.queue, poison_id)
    assert reason in letter.reason
    assert letter.payload == _payload(fields)
    assert isinstance(letter.time, float) and letter.dead_letter_id
    assert await _queue_pending(store) == 0
    stats = await store.statistics()
    assert stats["dead_letters"] == 1 and stats["pending"] == {"w1": 0}


@pytest.mark.parametrize(("fields", "reason"), POISON_QUEUE_ENTRIES)
async def test_poison_entry_does_not_block_the_same_call(
    real_store: RedisStore, fields: dict, reason: str
) -> None:
    """A dequeue that reads a poison entry goes on to claim the valid rollout after it."""
    store = real_store
    await store.queue.ensure()
    await store.redis.xadd(store.keys.queue, fields)
    await store.rollouts.enqueue_rollout("x", rollout_id="good")
    claimed = await store.queue.dequeue_rollout("w1", block_s=2)
    assert claimed is not None and claimed.rollout.rollout_id == "good"
    assert [reason in d.reason for d in await store.dead_letters.query_dead_letters()] == [True]
    assert await _queue_pending(store) == 0


async def test_poison_entries_skipped_within_one_batch(store: RedisStore) -> None:
    """Poison entries among valid ones are dead-lettered while the valid ones are claimed."""
    await store.queue.ensure()
    await store.rollouts.enqueue_rollout("a", rollout_id="a")
    await store.redis.xadd(store.keys.queue, {b"m": b"\xc1"})
    await store.redis.xadd(store.keys.queue, {b"m": QueueEntry("ghost").to_wire()})
    await store.rollouts.enqueue_rollout("b", rollout_id="b")
    claimed = await store.queue.dequeue_rollouts("w1", count=10)
    assert [c.rollout.rollout_id for c in claimed] == ["a", "b"]
    reasons = [d.reason for d in await store.dead_letters.query_dead_letters()]  # newest first
    assert len(reasons) == 2
    assert "rollout ghost does not exist" in reasons[0]
    assert "not a valid msgpack record" in reasons[1]
    assert await _queue_pending(store) == 0


async def test_dead_letters_newest_first_with_limit(store: RedisStore) -> None:
    """query_dead_letters lists the newest first, up to the limit."""
    await store.queue.ensure()
    ids = [(await store.redis.xadd(store.keys.queue, {b"n": str(i).encode()})).decode() for i in range(3)]
    await store.queue.dequeue_rollouts("w1", count=10)
    assert [d.entry_id for d in await store.dead_letters.query_dead_letters()] == ids[::-1]
    assert [d.entry_id for d in await store.dead_letters.query_dead_letters(limit=1)] == [ids[2]]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        pytest.param({b"m": b"\xc1garbage"}, "not a valid msgpack record", id="garbage"),
        pytest.param({b"x": b"1"}, "rollout_finished entry has no 'm' field", id="no-m-field"),
        pytest.param(
            {b"m": codec.pack_record("rollout_finished", {"status": "failed"})},
            "rollout_finished record has no 'rollout_id'",
            id="no-rollout-id",
        ),
        pytest.param(
            {b"m": msgpack.packb({"v": 99, "kind": "rollout_finished", "rollout_id": "x"})},
            "rollout_finished record has schema version 99",
            id="schema-99",
        ),
        pytest.param(
            {b"m": codec.pack_record("rollout_finished", {"rollout_id": "x", "status": "bogus"})},
            "rollout_finished record has unknown status 'bogus'",
            id="bad-status",
        ),
    ],
)
async def test_poison_completion_is_dead_lettered(store: RedisStore, fields: dict, reason: str) -> None:
    """A malformed finished entry is dead-lettered and acked; the valid ones are still read."""
    await store.finished.ensure_finished_group("adapter")
    poison_id = (await store.redis.xadd(store.keys.finished, fields)).decode()
    await store.rollouts.enqueue_rollout("x", rollout_id="r1")
    await store.rollouts.cancel_rollout("r1")

    got = await store.finished.read_finished("adapter", "c1")
    assert [(c.rollout_id, c.status) for c in got] == [("r1", RolloutStatus.CANCELLED)]
    letters = await store.dead_letters.query_dead_letters()
    assert [(d.source, d.entry_id) for d in letters] == [(store.keys.finished, poison_id)]
    assert reason in letters[0].reason
    assert letters[0].payload == _payload(fields)
    pending = await store.redis.xpending_range(store.keys.finished, "adapter", "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [got[0].entry_id]  # the poison one is acked
    # wait_for_rollouts reads past the poison entry without failing.
    assert [r.rollout_id for r in await store.finished.wait_for_rollouts(["r1"], timeout_s=0)] == ["r1"]


# --- decoders refuse unknown schema versions -----------------------------------------------------


def _record(kind: str, version: object, **fields: object) -> bytes:
    return msgpack.packb({"v": version, "kind": kind, **fields}, use_bin_type=True)


@pytest.mark.parametrize("version", [0, 2, 99, None, "1"])
def test_unpack_record_refuses_other_versions(version: object) -> None:
    """unpack_record refuses any version but the current one, naming it."""
    with pytest.raises(SchemaVersionError, match=f"queue record has schema version {version!r}"):
        codec.unpack_record(_record("queue", version, rollout_id="x"), "queue")


def test_unpack_record_refuses_missing_version() -> None:
    """A record without a version is refused as version None."""
    with pytest.raises(SchemaVersionError, match="schema version None"):
        codec.unpack_record(msgpack.packb({"kind": "queue", "rollout_id": "x"}), "queue")


@pytest.mark.parametrize(
    ("decode", "kind"),
    [
        (QueueEntry.from_wire, "queue"),
        (RolloutFinished.from_wire, "rollout_finished"),
        # a span record is positional: version 99 in the first place, whatever the fields
        (lambda _: Span.from_wire(msgpack.packb([99, "span", "r", "r.1", "s", None, "n", None, None, {}]), 1), "span"),
        (ResourcesUpdate.from_wire, "resources"),
        (DeadLetter.from_wire, "dead_letter"),
        (Worker.from_wire, "worker"),
    ],
)
def test_message_decoders_refuse_unknown_version(decode, kind: str) -> None:
    """Every stream-message decoder raises SchemaVersionError for version 99."""
    with pytest.raises(SchemaVersionError, match=f"{kind} record has schema version 99"):
        decode(_record(kind, 99, rollout_id="x"))


def test_message_decoders_round_trip_current_version() -> None:
    """The current version decodes back to the same record."""
    finished = RolloutFinished("r1", RolloutStatus.FAILED, "r1.2")
    assert RolloutFinished.from_wire(finished.to_wire()) == finished
    assert QueueEntry.from_wire(QueueEntry("r1").to_wire()) == QueueEntry("r1")
    span = Span("r1", "r1.1", "s1", "llm", attributes={"a": 1})
    assert Span.from_wire(span.to_wire(), 7) == Span(
        "r1", "r1.1", "s1", "llm", attributes={"a": 1}, sequence_id=7
    )


@pytest.mark.parametrize("decode", [Rollout.from_hash, Attempt.from_hash])
def test_hash_decoders_refuse_unknown_version(decode) -> None:
    """Rollout and attempt hashes of another schema version are refused."""
    with pytest.raises(SchemaVersionError, match="record has schema version 2"):
        decode({b"v": b"2", b"rollout_id": b"r1", b"status": b"queuing"})
    with pytest.raises(SchemaVersionError, match="record has schema version 0"):
        decode({b"rollout_id": b"r1", b"status": b"queuing"})


async def test_store_refuses_rollout_hash_of_unknown_version(store: RedisStore) -> None:
    """Reading a rollout stored by another schema version raises instead of misreading it."""
    await store.rollouts.enqueue_rollout("x", rollout_id="r1")
    await store.redis.hset(store.keys.rollout("r1"), "v", 2)
    with pytest.raises(SchemaVersionError, match="rollout record has schema version 2"):
        await store.rollouts.get_rollout("r1")


def test_other_decoding_errors_are_record_errors_not_version_errors() -> None:
    """Garbage, a wrong kind and an oversize record are RecordErrors, never SchemaVersionErrors."""
    for data, kind in [(b"\xc1", "queue"), (codec.pack_record("span", {}), "queue")]:
        with pytest.raises(RecordError) as info:
            codec.unpack_record(data, kind)
        assert not isinstance(info.value, SchemaVersionError)
    with pytest.raises(RecordTooLarge):
        codec.unpack(codec.pack("x" * 100), max_bytes=10)
    with pytest.raises(RecordTooLarge):
        codec.pack("x" * 100, max_bytes=10)
    with pytest.raises(RecordError, match="cannot encode as msgpack"):
        codec.pack({"x": object()})



async def test_a_dead_letter_from_a_hash_is_kept_not_requeued(store: RedisStore) -> None:
    """A letter set aside from a hash (an unreadable resources entry) is refused by requeue, naming its
    source, and stays; a letter from a stream goes back onto it."""
    await store.redis.hset(store.keys.resources("policy"), "v3", b"bad")
    await store.dead_letters.dead_letter(store.keys.resources("policy"), "v3", "unreadable", {b"m": b"bad"})
    await store.dead_letters.dead_letter(store.keys.queue, "1-1", "poison", {b"m": b"x"})
    from_stream, from_hash = await store.dead_letters.query_dead_letters()  # newest first
    with pytest.raises(InvalidInput, match="not a stream but a hash"):
        await store.dead_letters.requeue_dead_letter(from_hash.dead_letter_id)
    await store.dead_letters.requeue_dead_letter(from_stream.dead_letter_id)
    assert [d.dead_letter_id for d in await store.dead_letters.query_dead_letters()] == [from_hash.dead_letter_id]
    assert [fields for _, fields in await store.redis.xrange(store.keys.queue)] == [{b"m": b"x"}]
