"""The adapter's group judge against a real Redis and a fake OpenAI-compatible judge: a whole train
group is rescored in one call before its samples are written; a failing judge or a group that never
completes leaves its own rewards; nothing is acknowledged while held, and a dead adapter's held
group is taken over."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fakes.fake_openai import FakeOpenAI

from fulmen import keys as k
from fulmen.records import Sample, SampleSkip, Span
from fulmen.store import RedisStore
from fulmen.store.samples import decode_sample
from fulmen.telemetry import semconv
from fulmen_adapter.adapter import Adapter
from fulmen_adapter.judge import JudgeConfig

QUESTION = "What is 17 * 23?"


@pytest.fixture
def judge_server() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    fake.start_in_thread()
    yield fake
    fake.stop()


def scores(*values: float) -> str:
    return json.dumps({"scores": [{"trajectory": i, "score": v, "reason": "r"} for i, v in enumerate(values, 1)]})


def judge_config(server: FakeOpenAI, **kwargs: Any) -> JudgeConfig:
    return JudgeConfig(f"{server.base_url}/v1", "judge-model", **{"timeout_s": 10.0, **kwargs})


async def _rollout(store: RedisStore, answer: str, reward: float, *, group: str = "g", size: int = 3,
                   mode: str = "train", status: str = "succeeded") -> str:
    """A finished rollout with one chat call (its request and answer recorded) and a stored reward."""
    claimed = await store.rollouts.start_rollout({"q": QUESTION}, "w1", mode=mode,
                                                 metadata={"group_key": group, "group_size": size})
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    request = {"model": "policy", "messages": [{"role": "user", "content": QUESTION}]}
    await store.spans.add_spans([Span(rid, aid, f"root-{rid}", semconv.ROLLOUT_SPAN, start_time=9.0, end_time=11.0),
                                 Span(rid, aid, "c0", "chat policy", start_time=10.0, end_time=10.5, attributes={
        semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.PROMPT_TOKEN_IDS: [1, 2, 3],
        semconv.RESPONSE_TOKEN_IDS: [4, 5], semconv.RESPONSE_LOGPROBS: [-0.1, -0.2], semconv.MODEL_VERSION: "v1",
        semconv.REQUEST_JSON: json.dumps(request),
        semconv.RESPONSE_JSON: json.dumps({"role": "assistant", "content": answer}),
    })])
    await store.rollouts.update_attempt(rid, aid, status=status, reward=reward)
    return rid


async def _final_rewards(store: RedisStore) -> dict[str, float | None]:
    entries = [decode_sample(f[b"m"], store.max_record_bytes) for _, f in await store.redis.xrange(store.keys.samples)]
    return {e.rollout_id: e.final_reward if isinstance(e, Sample) else None for e in entries}


async def _pending(store: RedisStore) -> int:
    return (await store.redis.xpending(store.keys.finished, k.ADAPTER_GROUP))["pending"]


async def test_a_whole_group_is_rescored_in_one_call(real_store: RedisStore, judge_server: FakeOpenAI) -> None:
    """Three rollouts of one task, one judge call: their final rewards become its scores, in order; a
    validation rollout keeps its own; the call is marked and attributed to the group's first rollout."""
    answers = {await _rollout(real_store, answer, reward): answer
               for answer, reward in (("391", 1.0), ("400", 0.0), ("39", 0.5))}
    rids = list(answers)
    val = await _rollout(real_store, "391", 1.0, group="v", size=1, mode="val")
    judge_server.script(scores(0.9, 0.1, 0.3))
    adapter = Adapter(real_store, judge=judge_config(judge_server))
    await adapter.run(asyncio.Event(), until_idle=True)
    assert await _final_rewards(real_store) == {**dict(zip(sorted(rids), [0.9, 0.1, 0.3], strict=True)), val: 1.0}
    (request,) = judge_server.requests
    headers = {name.lower(): value for name, value in request.headers.items()}
    assert headers[semconv.HEADER_PURPOSE] == semconv.PURPOSE_JUDGE
    assert headers[semconv.HEADER_ROLLOUT_ID] == sorted(rids)[0]
    prompt = request.body["messages"][1]["content"]
    assert prompt.count(QUESTION) == 1  # shown once, before the trajectories, in the rollouts' order
    assert all(f"# Trajectory {i}\n[assistant] {answers[rid]}\n" in prompt + "\n" for i, rid in enumerate(sorted(rids), 1))
    assert request.body["model"] == "judge-model" and request.body["max_tokens"] == 1024
    stats = await real_store.samples.adapter_stats()
    assert (stats["judge/groups_judged"], stats["judge/rollouts_rescored"], stats["rollouts"]) == (1, 3, 4)
    assert adapter.counters.more == {"judge/groups_judged": 1, "judge/rollouts_rescored": 3}
    assert await _pending(real_store) == 0
    # the adapter's judgement is a span of its own in the first rollout's trace; the call's traceparent names it
    (span,) = await real_store.spans.query_spans(sorted(rids)[0], name="fulmen.judge")
    assert json.loads(span.attributes[semconv.OPERATION_OUTPUT])[0][:2] == [sorted(rids)[0], 0.9]
    assert span.status_code == "OK" and headers["traceparent"] == f"00-{span.trace_id}-{span.span_id}-01"
    assert span.parent_id == f"root-{sorted(rids)[0]}"


async def test_the_judges_score_can_be_mixed_with_the_agents_own(real_store: RedisStore,
                                                                 judge_server: FakeOpenAI) -> None:
    """judge_mix 0.25: a quarter of the judge's score, three quarters of the agent's reward."""
    own = {await _rollout(real_store, "a", 1.0, size=2): 1.0, await _rollout(real_store, "b", 0.0, size=2): 0.0}
    judged = [1.0 - own[rid] for rid in sorted(own)]  # the judge disagrees (scores go in rollout id order)
    judge_server.script(scores(*judged))
    await Adapter(real_store, judge=judge_config(judge_server, mix=0.25)).run(asyncio.Event(), until_idle=True)
    rewards = await _final_rewards(real_store)
    assert [rewards[rid] for rid in sorted(own)] == pytest.approx([0.25 * j + 0.75 * (1 - j) for j in judged])


@pytest.mark.parametrize("reply", [
    ["no JSON here", "still none"],  # unreadable twice: the judge's retry, then its error
    [{"status": 500}],  # the server fails
    [{"delay_s": 3.0, "content": scores(0.5, 0.5)}],  # slower than the judge's time-out
], ids=["junk", "error", "timeout"])
async def test_a_failing_judge_leaves_the_group_its_own_rewards(real_store: RedisStore, judge_server: FakeOpenAI,
                                                                reply: list[Any]) -> None:
    """Whatever goes wrong with the judge, the group is written with its own rewards, counted."""
    rids = [await _rollout(real_store, "a", 1.0, size=2), await _rollout(real_store, "b", 0.0, size=2)]
    judge_server.script(*reply)
    adapter = Adapter(real_store, judge=judge_config(judge_server, timeout_s=0.5))
    await adapter.run(asyncio.Event(), until_idle=True)
    rewards = await _final_rewards(real_store)
    assert {rewards[r] for r in rids} == {1.0, 0.0}
    stats = await real_store.samples.adapter_stats()
    assert stats["judge/groups_failed"] == 1 and "judge/rollouts_rescored" not in stats
    assert await _pending(real_store) == 0
    (span,) = await real_store.spans.query_spans(sorted(rids)[0], name="fulmen.judge")
    assert span.status_code == "ERROR" and span.status_message


async def test_a_group_is_held_unacknowledged_then_written_after_the_wait(real_store: RedisStore,
                                                                          judge_server: FakeOpenAI) -> None:
    """Two of three rollouts ended: nothing is written or acknowledged; past the wait the two are
    written with their own rewards and no judge is called; a failed member counts towards its group."""
    await _rollout(real_store, "a", 1.0)
    failed = await _rollout(real_store, "b", 0.0, status="failed")
    adapter = Adapter(real_store, judge=judge_config(judge_server, wait_s=30.0))
    await real_store.finished.ensure_finished_group(k.ADAPTER_GROUP)
    await adapter.process(await real_store.finished.read_finished(k.ADAPTER_GROUP, adapter.consumer, 10))
    assert await _final_rewards(real_store) == {} and await _pending(real_store) == 2
    assert adapter.groups is not None and adapter.groups.expire(time.monotonic()) == 0  # not yet
    assert adapter.groups.expire(time.monotonic() + 30.0) == 1
    await adapter.groups.drain()
    rewards = await _final_rewards(real_store)
    assert sorted(rewards.values(), key=str) == [1.0, None] and rewards[failed] is None  # the skip record
    assert judge_server.requests == [] and await _pending(real_store) == 0
    assert (await real_store.samples.adapter_stats())["judge/groups_incomplete"] == 1


async def test_a_dead_adapters_held_group_is_taken_over_and_judged_once(real_store: RedisStore,
                                                                        judge_server: FakeOpenAI) -> None:
    """An adapter that holds part of a group and dies leaves its entries pending; another takes them
    over once idle, gets the group's last rollout, judges the whole group and writes it once."""
    first = [await _rollout(real_store, "a", 1.0, size=2)]
    dead = Adapter(real_store, consumer="dead", judge=judge_config(judge_server))
    await real_store.finished.ensure_finished_group(k.ADAPTER_GROUP)
    await dead.process(await real_store.finished.read_finished(k.ADAPTER_GROUP, "dead", 10))
    assert dead.groups is not None
    await dead.groups.close()  # it dies holding the group
    first.append(await _rollout(real_store, "b", 0.0, size=2))
    judge_server.script(scores(0.2, 0.8))
    survivor = Adapter(real_store, consumer="survivor", reclaim_idle_s=0.05, judge=judge_config(judge_server))
    await asyncio.sleep(0.1)  # the dead adapter's entry goes idle
    await survivor.run(asyncio.Event(), until_idle=True)
    rewards = await _final_rewards(real_store)
    assert [rewards[r] for r in sorted(first)] == [0.2, 0.8] and len(judge_server.requests) == 1
    assert await _pending(real_store) == 0
    # delivered again: this adapter remembers the group (no second judge call), and one that does not
    # judges it again, but nothing is written twice
    await real_store.redis.xgroup_setid(real_store.keys.finished, k.ADAPTER_GROUP, "0")
    await survivor.run(asyncio.Event(), until_idle=True)
    assert len(judge_server.requests) == 1
    await real_store.redis.xgroup_setid(real_store.keys.finished, k.ADAPTER_GROUP, "0")
    await Adapter(real_store, judge=judge_config(judge_server)).run(asyncio.Event(), until_idle=True)
    assert len(await real_store.redis.xrange(real_store.keys.samples)) == 2 and await _pending(real_store) == 0


async def test_a_skipped_member_is_not_judged(real_store: RedisStore, judge_server: FakeOpenAI) -> None:
    """A failed rollout completes its group but is no trajectory of the judge's call; its skip stays."""
    ok = await _rollout(real_store, "a", 1.0, size=2)
    failed = await _rollout(real_store, "b", 0.0, size=2, status="failed")
    judge_server.script(scores(0.4))
    await Adapter(real_store, judge=judge_config(judge_server)).run(asyncio.Event(), until_idle=True)
    entries = {e.rollout_id: e for e in (decode_sample(f[b"m"], real_store.max_record_bytes)
                                         for _, f in await real_store.redis.xrange(real_store.keys.samples))}
    assert isinstance(entries[failed], SampleSkip)
    assert isinstance(entries[ok], Sample) and entries[ok].final_reward == 0.4
    assert "# Trajectory 2" not in judge_server.requests[0].body["messages"][1]["content"]
