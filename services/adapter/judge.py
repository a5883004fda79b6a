"""The adapter's group judge: one `fulmen.rewards.judge` call rescores the rollouts of one task (the
conversation of each one's last LLM call), and their final rewards become the judge's scores, or a
mix with their own. Holding a group until all its rollouts have ended: `fulmen_adapter.groups`.
Why: docs/design/adapter.md, "A judge for a whole group".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fulmen.errors import RecordError
from fulmen.records import RolloutForSamples, RolloutStatus, Span
from fulmen.telemetry import semconv
from fulmen.telemetry.tracing import rollout_trace_id
from fulmen_adapter.triplets import Skip, SpanLike, dedupe, match_rewards

log = logging.getLogger(__name__)

NO_API_KEY = "fulmen"  # what the OpenAI client sends when no key is set (it refuses none)
OPERATION = "fulmen.judge"  # the judge's span: the name fulmen.rewards.judge gives its own
SERVICE_NAME = "fulmen-adapter"


@dataclass(frozen=True)
class JudgeConfig:
    """The judge's server and how its scores become rewards (`AdapterSettings`' judge group)."""

    url: str  # an OpenAI-compatible base URL, .../v1
    model: str
    api_key: str | None = None
    rubric: str | None = None  # None: fulmen.rewards.DEFAULT_RUBRIC
    mix: float = 1.0  # the judge's share of the final reward
    wait_s: float = 120.0  # longest wait for a group's last rollout
    timeout_s: float = 60.0  # longest a group's judging may take, every try
    max_tokens: int = 1024


@dataclass(frozen=True)
class Judged:
    """What the judge made of one group: new final rewards by rollout id (empty when it failed or had
    nothing to judge), the outcome (``judged``, ``failed`` or ``unjudged``) and the judge's span for
    the trace of the group's first rollout (None when nothing was judged)."""

    rewards: dict[str, float]
    outcome: str
    span: Span | None = None


class GroupJudge:
    """Scores groups through one OpenAI client for the judge's server (made on first use, on the
    adapter's event loop). Never raises for the judge's failures: the group keeps its own rewards."""

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        self._client: Any = None

    async def rewards(self, group_key: str, members: Sequence[RolloutForSamples]) -> Judged:
        """The group's new final rewards: each member with a conversation is one trajectory of one
        judge call (a failed rollout, or one without an LLM call, is left out and keeps its records)."""
        inputs = {r.rollout_id: judged_input(r) for r in members}
        judged = {rid: inputs[rid] for rid in sorted(inputs) if inputs[rid] is not None}
        if not judged:
            return Judged({}, "unjudged")
        from fulmen.rewards import judge

        first = next(r for r in members if r.rollout_id == next(iter(judged)))
        span = _judge_span(first, group_key, self.config.model, list(judged))
        started = time.monotonic()
        try:
            verdicts = await asyncio.wait_for(
                judge([conversation for conversation, _ in judged.values()], rubric=self.config.rubric or _rubric(),
                      client=self._attributed(span), model=self.config.model,
                      options={"max_tokens": self.config.max_tokens}),
                self.config.timeout_s,
            )
        except Exception as e:  # the judge's failure costs the group its rescoring, never the stream
            problem = f"timed out after {self.config.timeout_s:g} s" if isinstance(e, TimeoutError) else (
                f"{type(e).__name__}: {e}")
            log.warning("the judge failed on group %s (%d rollouts) after %.1f s, own rewards kept: %s",
                        group_key, len(judged), time.monotonic() - started, problem[:500])
            return Judged({}, "failed", _ended(span, "ERROR", problem[:2000], None))
        mix = self.config.mix
        rewards = {
            rid: float(v) if own is None else mix * float(v) + (1 - mix) * own
            for (rid, (_, own)), v in zip(judged.items(), verdicts, strict=True)
        }
        log.info("judged group %s in %.1f s: %s", group_key, time.monotonic() - started,
                 ", ".join(f"{rid} {float(v):.2f}" for rid, v in zip(judged, verdicts, strict=True)))
        output = [[rid, float(v), v.reason, rewards[rid]] for rid, v in zip(judged, verdicts, strict=True)]
        return Judged(rewards, "judged", _ended(span, "OK", "", output))

    def _attributed(self, span: Span) -> Any:
        """The client, its calls attributed to the group's first rollout and under the judge's span:
        a proxy that shares this experiment stores them in that rollout's trace, marked as the
        judge's (so never sampled)."""
        if self._client is None:
            import openai

            self._client = openai.AsyncOpenAI(base_url=self.config.url, api_key=self.config.api_key or NO_API_KEY,
                                              timeout=self.config.timeout_s, max_retries=0)
        return self._client.copy(default_headers={
            semconv.HEADER_ROLLOUT_ID: span.rollout_id, semconv.HEADER_ATTEMPT_ID: span.attempt_id,
            "traceparent": f"00-{span.trace_id}-{span.span_id}-01",
        })

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


def _rubric() -> str:
    from fulmen.rewards import DEFAULT_RUBRIC

    return DEFAULT_RUBRIC


def _judge_span(first: RolloutForSamples, group_key: str, model: str, rollout_ids: list[str]) -> Span:
    """The judge's operation span, begun: in the trace of the group's first rollout (the rollout's
    trace id, as the runner's and the proxy's spans have it), under its root span, its id derived from
    the group (a group judged again after a crash is one span)."""
    attempt_id = first.attempt_id or ""
    spans = first.spans if not isinstance(first.spans, RecordError) else []
    root = next((s for s in spans if s.name == semconv.ROLLOUT_SPAN and s.attempt_id == attempt_id), None)
    trace_id = f"{rollout_trace_id(first.rollout_id):032x}"
    span_id = hashlib.blake2b(f"{attempt_id}\0judge\0{group_key}".encode(), digest_size=8).hexdigest()
    attributes = {
        semconv.SPAN_KIND: semconv.KIND_OPERATION, semconv.OPERATION_NAME: OPERATION,
        semconv.OPERATION_INPUT: json.dumps({"group_key": group_key, "rollouts": rollout_ids}),
        "fulmen.judge.model": model, "fulmen.judge.trajectories": len(rollout_ids),
    }
    return Span(first.rollout_id, attempt_id, span_id, OPERATION, trace_id, root.span_id if root else None,
                start_time=time.time(), attributes=attributes, resource={"service.name": SERVICE_NAME})


def _ended(span: Span, status: str, message: str, output: list[Any] | None) -> Span:
    attributes = dict(span.attributes)
    if output is not None:  # [rollout id, score, reason, final reward] per trajectory
        attributes[semconv.OPERATION_OUTPUT] = json.dumps(output)
    return replace(span, end_time=time.time(), status_code=status, status_message=message, attributes=attributes)


def judged_input(rollout: RolloutForSamples) -> tuple[list[dict[str, Any]] | str, float | None] | None:
    """(what the judge sees of a rollout, its own final reward), or None when there is nothing to
    judge: not succeeded, unreadable spans, no LLM call of the policy. What it sees is its latest
    attempt's last policy call: the request's messages and the answer, which for a chat agent that
    sends its history each turn is the whole conversation (tool calls and results included)."""
    spans = rollout.spans
    if rollout.status is not RolloutStatus.SUCCEEDED or isinstance(spans, RecordError):
        return None
    unique = dedupe(spans, rollout.attempt_id or "")
    last = _last_policy_call(unique)
    if last is None:
        return None
    try:
        own = rollout.reward if rollout.reward is not None else match_rewards(unique, [])
    except Skip:  # a malformed reward span: the adapter skips the rollout anyway
        return None
    conversation = _conversation(last)
    if conversation is None or (own is not None and not math.isfinite(own)):
        return None
    return conversation, own


def _last_policy_call(spans: Sequence[SpanLike]) -> SpanLike | None:
    last, last_key = None, (-math.inf, -1)
    for s in spans:
        attributes = s.attributes
        if attributes.get(semconv.SPAN_KIND) != semconv.KIND_LLM_CALL:
            continue
        if attributes.get(semconv.CALL_PURPOSE) not in (None, semconv.PURPOSE_POLICY):
            continue
        key = (s.end_time if s.end_time is not None else math.inf, s.sequence_id)
        if key > last_key:
            last, last_key = s, key
    return last


def _conversation(span: SpanLike) -> list[dict[str, Any]] | str | None:
    """The chat messages and answer of a call's span (a completion call's prompt and text)."""
    try:
        request = json.loads(span.attributes.get(semconv.REQUEST_JSON) or "null")
        answer = json.loads(span.attributes.get(semconv.RESPONSE_JSON) or "null")
    except (TypeError, ValueError):
        return None
    if not isinstance(request, dict) or not isinstance(answer, dict):
        return None
    messages = request.get("messages")
    if isinstance(messages, list):
        return [*messages, {"role": "assistant", **answer}]
    prompt = request.get("prompt")
    if isinstance(prompt, str) and isinstance(answer.get("text"), str):
        return prompt + answer["text"]
    return None
