"""Finished-stream entries that decode but cannot be acted on: the adapter dead-letters each with the
reason and goes on; it acts only on terminal rollouts (issue 20, items 7 and 14)."""

from __future__ import annotations

import asyncio

import pytest

from fulmen import codec
from fulmen import keys as k
from fulmen.records import RolloutFinished, RolloutStatus, Sample, Span
from fulmen.store import RedisStore
from fulmen.store.samples import decode_sample
from fulmen.telemetry import semconv
from fulmen_adapter.adapter import Adapter


async def _call_and_reward(store: RedisStore, rid: str, aid: str) -> None:
    await store.spans.add_spans([
        Span(rid, aid, "c0", "chat tiny", start_time=10.0, end_time=10.5,
             attributes={semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.PROMPT_TOKEN_IDS: [1, 2],
                         semconv.RESPONSE_TOKEN_IDS: [3], semconv.RESPONSE_LOGPROBS: [-0.1]}),
        Span(rid, aid, "w", semconv.REWARD_SPAN, start_time=20.0, end_time=20.0,
             attributes={semconv.SPAN_KIND: semconv.KIND_REWARD, semconv.REWARD: 1.0}),
    ])


async def _succeeded(store: RedisStore, task: object) -> str:
    claimed = await store.rollouts.start_rollout(task, "w1")
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    await _call_and_reward(store, rid, aid)
    await store.rollouts.update_attempt(rid, aid, status="succeeded")
    return rid


async def _samples(store: RedisStore) -> list:
    return [decode_sample(f[b"m"], store.max_record_bytes) for _, f in await store.redis.xrange(store.keys.samples)]


async def test_a_forged_finished_entry_for_a_running_rollout_is_dead_lettered(real_store: RedisStore) -> None:
    """The running rollout is not marked sampled: once it really ends, its samples are written."""
    store = real_store
    claimed = await store.rollouts.start_rollout("task", "w1")
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    await store.redis.xadd(store.keys.finished, {"m": RolloutFinished(rid, RolloutStatus.SUCCEEDED, aid).to_wire()})
    adapter = Adapter(store)
    await adapter.run(asyncio.Event(), until_idle=True)
    assert await _samples(store) == []
    (letter,) = await store.dead_letters.query_dead_letters()
    assert "not terminal" in letter.reason and letter.source == store.keys.finished
    await _call_and_reward(store, rid, aid)
    await store.rollouts.update_attempt(rid, aid, status="succeeded")
    await adapter.run(asyncio.Event(), until_idle=True)
    assert [type(s) for s in await _samples(store)] == [Sample]
    assert (await store.redis.xpending(store.keys.finished, k.ADAPTER_GROUP))["pending"] == 0


@pytest.mark.parametrize("rollout_id", [7, None, "", "no such\nid"])
async def test_a_finished_entry_with_an_unusable_rollout_id_is_dead_lettered(
    real_store: RedisStore, rollout_id: object
) -> None:
    """A number, null, empty or invalid rollout id: dead-lettered with the reason, the next rollout adapted."""
    store = real_store
    await store.finished.ensure_finished_group(k.ADAPTER_GROUP)
    poison = codec.pack_record("rollout_finished", {"rollout_id": rollout_id, "status": "succeeded"})
    await store.redis.xadd(store.keys.finished, {"m": poison})
    await _succeeded(store, "next")
    await Adapter(store).run(asyncio.Event(), until_idle=True)
    (letter,) = await store.dead_letters.query_dead_letters()
    assert "rollout_id" in letter.reason
    assert [type(s) for s in await _samples(store)] == [Sample]


async def test_a_rollout_that_fails_to_adapt_is_dead_lettered_alone(
    real_store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected error while adapting one rollout sets its entry aside; the rest of the batch is adapted."""
    store = real_store
    bad = await _succeeded(store, "bad")
    good = await _succeeded(store, "good")
    adapter = Adapter(store)
    adapt = adapter._adapt

    def failing(rollout):  # type: ignore[no-untyped-def]
        if rollout.rollout_id == bad:
            raise KeyError("boom")
        return adapt(rollout)

    monkeypatch.setattr(adapter, "_adapt", failing)
    await adapter.run(asyncio.Event(), until_idle=True, lanes=1)
    assert [s.rollout_id for s in await _samples(store)] == [good]
    (letter,) = await store.dead_letters.query_dead_letters()
    assert bad in letter.reason and "KeyError" in letter.reason
    assert (await store.redis.xpending(store.keys.finished, k.ADAPTER_GROUP))["pending"] == 0


async def test_an_oversize_finished_entry_does_not_stop_the_adapter(real_store: RedisStore) -> None:
    """200 fields of 70 KB: its dead letter is truncated, and the adapter goes on to the next rollout."""
    store = real_store
    await store.finished.ensure_finished_group(k.ADAPTER_GROUP)
    await store.redis.xadd(store.keys.finished, {f"f{i}".encode(): b"x" * 70_000 for i in range(200)})
    await _succeeded(store, "next")
    await Adapter(store).run(asyncio.Event(), until_idle=True)
    (letter,) = await store.dead_letters.query_dead_letters()
    assert "truncated" in letter.reason
    assert [type(s) for s in await _samples(store)] == [Sample]


async def test_a_finished_entry_for_an_unknown_rollout_is_dead_lettered_with_a_warning(
    real_store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry for a rollout id never enqueued: dead-lettered with the reason and a warning, acknowledged;
    the rollouts beside it in the batch are adapted."""
    store = real_store
    await store.finished.ensure_finished_group(k.ADAPTER_GROUP)
    before = await _succeeded(store, "before")
    ghost = RolloutFinished("ro-never-enqueued", RolloutStatus.SUCCEEDED, "ro-never-enqueued.1")
    entry_id = (await store.redis.xadd(store.keys.finished, {"m": ghost.to_wire()})).decode()
    after = await _succeeded(store, "after")
    with caplog.at_level("WARNING", logger="fulmen.store.finished"):
        await Adapter(store).run(asyncio.Event(), until_idle=True, lanes=1)
    (letter,) = await store.dead_letters.query_dead_letters()
    assert letter.reason == "finished entry for unknown rollout ro-never-enqueued"
    assert (letter.source, letter.entry_id) == (store.keys.finished, entry_id)
    assert RolloutFinished.from_wire(letter.payload["m"]).rollout_id == "ro-never-enqueued"
    assert any(r.levelname == "WARNING" and "ro-never-enqueued" in r.getMessage() for r in caplog.records)
    assert (await store.redis.xpending(store.keys.finished, k.ADAPTER_GROUP))["pending"] == 0
    assert sorted(s.rollout_id for s in await _samples(store)) == sorted([before, after])
