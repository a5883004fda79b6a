"""A small experiment with everything the dashboard shows: rollouts in several statuses, an attempt
with a span tree holding an LLM call and a reward, trainer steps, a validation pass, a dead letter."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx

from fulmen import tokens
from fulmen.records import Span
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.telemetry.steps import append_step, summarize

Client = Callable[..., httpx.AsyncClient]  # the `dashboard` fixture: an httpx client on a dashboard app
QUESTION = "What is 17 + 25?"
ANSWER = "42"


def llm_span(rollout_id: str, attempt_id: str, parent_id: str, version: str = "v3") -> Span:
    request = {"model": "policy", "messages": [{"role": "system", "content": "You add numbers."},
                                               {"role": "user", "content": QUESTION}], "max_tokens": 8}
    return Span(
        rollout_id, attempt_id, f"llm-{attempt_id}", "chat policy", parent_id=parent_id,
        start_time=time.time() - 0.5, end_time=time.time() - 0.4,
        attributes={
            semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.MODEL_VERSION: version,
            semconv.REQUEST_JSON: json.dumps(request),
            semconv.RESPONSE_JSON: json.dumps({"role": "assistant", "content": ANSWER,
                                               "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "calc", "arguments": "{}"}}]}),
            semconv.PROMPT_TOKEN_IDS: tokens.pack_ids([5, 6, 7, 8, 9]),
            semconv.RESPONSE_TOKEN_IDS: tokens.pack_ids([11, 12]),
            semconv.RESPONSE_LOGPROBS: tokens.pack_floats([-0.25, -0.5]),
            semconv.GEN_AI_INPUT_TOKENS: 5, semconv.GEN_AI_OUTPUT_TOKENS: 2, semconv.LATENCY_MS: 12.5,
        },
    )


async def seed(store: RedisStore, succeeded: int = 3, queued: int = 2) -> list[str]:
    """Returns the ids of the succeeded rollouts (each with an LLM call, reward 1.0)."""
    ids = []
    for i in range(succeeded):
        await store.rollouts.enqueue_rollout({"question": QUESTION, "n": i}, rollout_id=f"ok-{i}", mode="train")
        [claimed] = await store.queue.dequeue_rollouts("worker-1", count=1, block_s=1)
        rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
        root = Span(rid, aid, f"root-{aid}", semconv.ROLLOUT_SPAN, start_time=time.time() - 1, end_time=time.time(),
                    attributes={semconv.SPAN_KIND: semconv.KIND_ROLLOUT})
        reward = Span(rid, aid, f"reward-{aid}", semconv.REWARD_SPAN, parent_id=root.span_id,
                      start_time=time.time(), end_time=time.time(),
                      attributes={semconv.SPAN_KIND: semconv.KIND_REWARD, semconv.REWARD: 1.0})
        await store.spans.add_spans([root, llm_span(rid, aid, root.span_id), reward])
        await store.rollouts.update_attempt(rid, aid, status="succeeded", reward=1.0)
        ids.append(rid)
    for i in range(queued):
        await store.rollouts.enqueue_rollout({"question": "later", "n": i}, rollout_id=f"wait-{i}", mode="val")
    for step in range(1, 6):
        metrics = {"model_version": f"v{step}", "rollout/reward_mean": 0.1 * step, "loss/total": 1.0 / step,
                   "loss/kl": 0.01 * step, "loss/entropy": 2.0 - 0.1 * step, "perf/tokens_per_s": 100.0 + step}
        await append_step(store.redis, store.keys, summarize(step, metrics, time.time()))
    await store.redis.xadd(store.keys.validations, {"m": json.dumps(
        {"label": "v0", "step": 0, "accuracy": 0.45, "mean_reward": 0.45, "served_by": {"v0": 3}})})
    await store.redis.xadd(store.keys.validations, {"m": json.dumps(
        {"label": "v5", "step": 5, "accuracy": 0.7, "mean_reward": 0.7, "served_by": {"v5": 3}})})
    await store.dead_letters.dead_letter(store.keys.samples, "1-0", "sample record unreadable: <script>alert(1)</script>",
                            {b"m": b"\x00garbage"})
    return ids
