"""Property-based fuzz of the streams the services consume (issue 20, "Validation at the boundary").

Each example writes, to a fresh experiment on the session's real Redis, one entry that decodes as
msgpack but holds a hostile record (a field replaced by a value of another type, out of range, NaN,
huge, or removed; an unknown field; oversize entry fields), then one valid entry. The consumer must
stay up, set the hostile entry aside with a reason (a dead letter for a consumer group; a skip for a
broadcast stream, which has no group) unless it happens to be valid, and process the valid entry.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fulmen import codec
from fulmen import keys as k
from fulmen.records import ControlMessage, ResourcesUpdate, RolloutFinished, RolloutStatus, Sample, Span
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.telemetry import semconv
from fulmen_adapter.adapter import Adapter
from fulmen_llm_proxy.control import ControlFollower
from fulmen_llm_proxy.gate import Gate
from fulmen_trainer.trainer import Trainer

FUZZ = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BIG = b"\x00" * 70_000  # one field of an oversize entry

HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 2**31, "", " ", "a\nb", "x" * 300, b"", b"\xff\xff\xff\x7f", b"\x01\x02\x03"]),
    st.text(max_size=12),
    st.binary(max_size=24),
    st.lists(st.one_of(st.integers(min_value=-(2**31), max_value=2**31), st.text(max_size=3)), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(min_value=-(2**63), max_value=2**63), max_size=2),
)


@st.composite
def hostile_entry(draw: st.DrawFn, valid: dict[str, Any]) -> dict[bytes, bytes]:
    """A stream entry whose record is ``valid`` with one field replaced, removed or added, and maybe
    oversize fields beside the record."""
    record = dict(valid)
    name = draw(st.sampled_from([*valid, "unknown_field"]))
    if name in valid and draw(st.booleans()):
        del record[name]
    else:
        record[name] = draw(HOSTILE)
    fields = {b"m": codec.pack({"v": codec.SCHEMA_VERSION, "kind": draw(st.just(valid["kind"])), **record})}
    for i in range(draw(st.integers(min_value=0, max_value=2))):
        fields[f"pad{i}".encode()] = BIG
    return fields


def _record(record: Any) -> dict[str, Any]:
    """A valid record's fields, as a map (with its kind)."""
    return codec.unpack(record.to_wire())


def _run(redis_server: EmbeddedRedis, body: Callable[[RedisStore], Awaitable[None]]) -> None:
    """Run ``body`` on a store of a new experiment (each example is independent)."""

    async def main() -> None:
        client = aioredis.from_url(redis_server.url)
        try:
            await body(RedisStore(client, f"fz-{uuid.uuid4().hex[:10]}"))
        finally:
            await client.aclose()

    asyncio.run(main())


async def _letters_have_reasons(store: RedisStore, source: str) -> list[str]:
    letters = await store.dead_letters.query_dead_letters(limit=10)
    assert all(letter.reason and letter.source == source for letter in letters)
    return [letter.entry_id for letter in letters]


async def _succeeded_rollout(store: RedisStore, task: str) -> str:
    claimed = await store.rollouts.start_rollout(task, "w1")
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    await store.spans.add_spans([
        Span(rid, aid, "c0", "chat", start_time=1.0, end_time=1.5,
             attributes={semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.PROMPT_TOKEN_IDS: [1, 2],
                         semconv.RESPONSE_TOKEN_IDS: [3], semconv.RESPONSE_LOGPROBS: [-0.5]}),
    ])
    await store.rollouts.update_attempt(rid, aid, status="succeeded", reward=1.0)
    return rid


# --- consumer groups: the entry is dead-lettered with a reason, the valid one is processed ---------------


@FUZZ
@given(entry=hostile_entry({"kind": "queue", "rollout_id": "ghost"}))
def test_fuzz_queue(redis_server: EmbeddedRedis, entry: dict[bytes, bytes]) -> None:
    """Runners (claiming from the queue) dead-letter the hostile entry and claim the valid rollout."""

    async def body(store: RedisStore) -> None:
        await store.queue.ensure()
        poison_id = (await store.redis.xadd(store.keys.queue, entry)).decode()
        await store.rollouts.enqueue_rollout("task", rollout_id="good")
        claimed = [c.rollout.rollout_id for c in await store.queue.dequeue_rollouts("w1", count=10)]
        claimed += [c.rollout.rollout_id for c in await store.queue.dequeue_rollouts("w1", count=10)]
        assert claimed == ["good"]
        assert await _letters_have_reasons(store, store.keys.queue) == [poison_id]
        assert (await store.redis.xpending(store.keys.queue, k.RUNNERS_GROUP))["pending"] == 0

    _run(redis_server, body)


@FUZZ
@given(entry=hostile_entry(_record(RolloutFinished("ghost", RolloutStatus.SUCCEEDED, "ghost.1"))))
def test_fuzz_finished(redis_server: EmbeddedRedis, entry: dict[bytes, bytes]) -> None:
    """The adapter sets the hostile entry aside (or finds nothing to adapt) and adapts the valid rollout;
    the rollout the template names is running, so an entry that still decodes is a forged one."""

    async def body(store: RedisStore) -> None:
        await store.finished.ensure_finished_group(k.ADAPTER_GROUP)
        await store.rollouts.start_rollout("running", "w1", rollout_id="ghost")
        await store.redis.xadd(store.keys.finished, entry)
        good = await _succeeded_rollout(store, "task")
        await Adapter(store).run(asyncio.Event(), until_idle=True, lanes=1)
        samples = [codec.unpack(f[b"m"]) for _, f in await store.redis.xrange(store.keys.samples)]
        assert [s["rollout_id"] for s in samples] == [good]  # nothing for the running rollout, not even a skip
        assert len(await _letters_have_reasons(store, store.keys.finished)) <= 1
        assert (await store.redis.xpending(store.keys.finished, k.ADAPTER_GROUP))["pending"] == 0

    _run(redis_server, body)


_SAMPLE = Sample("r.1/t0", "triplet", "r", "r.1", "g", 0, [1, 2], [3, 4], [-0.5, -0.25], [1, 1], 1.0, 1.0,
                 "base", mode="train", group_size=2)


@FUZZ
@given(entry=hostile_entry(_record(_SAMPLE)))
def test_fuzz_samples(redis_server: EmbeddedRedis, tmp_path_factory: Any, entry: dict[bytes, bytes]) -> None:
    """The trainer dead-letters the hostile sample (or groups it, if it is usable) and groups the valid one."""
    model_dir = Path(tmp_path_factory.getbasetemp())

    async def body(store: RedisStore) -> None:
        await store.samples.ensure_samples_group(k.TRAINERS_GROUP)
        poison_id = (await store.redis.xadd(store.keys.samples, entry)).decode()
        good = Sample("good.1/t0", "triplet", "good", "good.1", "valid", 0, [1], [2], [-1.0], [1], 0.5, 0.5, "base")
        await store.redis.xadd(store.keys.samples, {"m": good.to_wire()})
        trainer = Trainer(store, load_settings(TrainerSettings, model_dir=model_dir))
        trainer.vocab_size = 64
        await trainer.take(await store.samples.read_samples(k.TRAINERS_GROUP, trainer.consumer, count=10))
        assert [s.sample_id for _, s in trainer.collector.groups["valid"].samples["good"]] == ["good.1/t0"]
        letters = await _letters_have_reasons(store, store.keys.samples)
        grouped = {e for g in trainer.collector.groups.values() for e in g.entry_ids()}
        assert (poison_id in letters) != (poison_id in grouped)  # set aside, or usable and grouped

    _run(redis_server, body)


# --- broadcast streams: the entry is skipped (or applied, if valid), and the reader goes on -------------


_RESOURCES = ResourcesUpdate("policy", 1, {"llm": {"model_version": "v1"}}, 1.0)


@FUZZ
@given(entry=hostile_entry(_record(_RESOURCES)))
def test_fuzz_resources_log(redis_server: EmbeddedRedis, entry: dict[bytes, bytes]) -> None:
    """Latest resources and a follower of the log pass over the hostile entry and see the valid version."""

    async def body(store: RedisStore) -> None:
        cursor = await store.resources.log.cursor("0-0")
        await store.redis.xadd(store.keys.resources_log, entry)
        latest = await store.resources.get_latest_resources()
        assert latest is None or isinstance(latest, ResourcesUpdate)
        update = await store.resources.add_resources({"llm": {"model_version": "v7"}}, "mine")
        assert await store.resources.get_latest_resources() == update
        seen = [u for _, u in await cursor.read(None)]
        assert seen[-1] == update and len(seen) <= 2

    _run(redis_server, body)


_CONTROL = ControlMessage.from_wire(codec.pack_record("control", {"action": "pause", "control_id": "x",
                                                                  "proxy_ids": [], "timeout_s": 60.0,
                                                                  "time": 1.0}))


@FUZZ
@given(entry=hostile_entry(_record(_CONTROL)))
def test_fuzz_control(redis_server: EmbeddedRedis, entry: dict[bytes, bytes]) -> None:
    """A proxy's control follower skips (or obeys, if valid) the hostile message and obeys the next one."""

    async def body(store: RedisStore) -> None:
        from fulmen_llm_proxy.control import _decode

        stream = store.ctx.stream(store.keys.control, _decode)
        cursor = await stream.cursor("0-0")
        await store.redis.xadd(store.keys.control, entry)
        resume = ControlMessage.from_wire(codec.pack_record(
            "control", {"action": "resume", "control_id": "good", "time": time.time()}))
        await store.redis.xadd(store.keys.control, {"m": resume.to_wire()})
        gate = Gate()
        follower = ControlFollower(store, gate, "p1", lambda: None)
        try:
            for _, message in await cursor.read(None):
                follower.apply(message, elapsed_s=0.0)
                assert message.timeout_s is None or math.isfinite(message.timeout_s)
        finally:
            follower.close()
        assert (follower.control_id, gate.state) == ("good", "serving")

    _run(redis_server, body)
