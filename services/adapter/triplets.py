"""Spans of one attempt → training samples (Agent Lightning's TracerTraceToTriplet, plus trajectories).

Pure: spans in, samples out, or `Skip` with the reason. How calls, rewards and trajectories are
matched: docs/design/adapter.md; the wire format: `fulmen.tokens`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

from fulmen import tokens
from fulmen.codec import SCHEMA_VERSION
from fulmen.errors import RecordError
from fulmen.records import Sample, Span, SpanView
from fulmen.telemetry import semconv

# The adapter hands in `SpanView`s (decoded cheaply from the store); tests and tools may use `Span`s.
SpanLike = Span | SpanView


class Skip(Exception):
    """The attempt yields no sample: ``code`` is counted in the metrics, the message says why."""

    def __init__(self, code: str, message: str | None = None) -> None:
        super().__init__(message or code.replace("_", " "))
        self.code = code


@dataclass(frozen=True)
class AdapterConfig:
    llm_call_match: str | None = None  # regex on span names; None: the proxy's llm_call spans
    agent_match: str | None = None  # regex: keep only calls under a span whose name matches
    trajectories: bool = True  # also emit joined multi-turn samples
    # (request JSON, response JSON) -> (prompt ids, response ids) for calls recorded without ids
    retokenize: Callable[[str, str], tuple[list[int], list[int]]] | None = None

    def __post_init__(self) -> None:
        for name in ("llm_call_match", "agent_match"):
            pattern = getattr(self, name)
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ValueError(f"{name} {pattern!r} is not a regular expression: {e}") from None


class AttemptInfo(NamedTuple):  # a tuple: one is made per rollout, cheaper than a frozen dataclass
    rollout_id: str
    attempt_id: str
    group_key: str
    mode: str | None = None
    group_size: int | None = None
    reward: float | None = None  # the final reward the runner stored (None: none stored)


@dataclass(slots=True)
class LlmCall:
    """One LLM call; its token ids and log-probabilities stay packed (`fulmen.tokens`) throughout:
    prefix matching and joining are bytes operations, and the samples carry the bytes as they are."""

    span: SpanLike
    prompt: bytes  # token ids as byte planes (`fulmen.tokens.pack_ids`)
    response: bytes  # token ids as byte planes
    logprobs: bytes  # float32, one per response token
    reward: float | None = None
    request_json: str = ""
    response_json: str = ""
    retokenized: bool = False  # ids made by the adapter from the call's text (no log-probabilities)


def _time(value: float | None) -> float:
    return value if value is not None else math.inf


def _call_order(span: SpanLike) -> tuple[float, int]:
    start = span.start_time
    return (start if start is not None else math.inf), span.sequence_id


_BY_SEQUENCE = attrgetter("sequence_id")
_FIRST_TWO = itemgetter(0, 1)


def dedupe(spans: Iterable[SpanLike], attempt_id: str | None = None) -> list[SpanLike]:
    """One span per span id (the first stored), in store order; only ``attempt_id``'s if given."""
    seen: set[str] = set()
    unique = []
    for s in sorted(spans, key=_BY_SEQUENCE):
        span_id = s.span_id
        if span_id not in seen and (attempt_id is None or s.attempt_id == attempt_id):
            seen.add(span_id)
            unique.append(s)
    return unique


def repaired_parents(spans: Sequence[SpanLike]) -> dict[str, str | None]:
    """Each span's parent within the attempt. A parent that was never stored (lost, or outside the
    runner) is replaced by the attempt's root span, so nothing hangs loose."""
    parents = {s.span_id: s.parent_id for s in spans}  # a span id stored twice: its last span's parent
    missing = set(parents.values()).difference(parents)
    missing.discard(None)
    if not missing:  # every parent is stored (the usual trace): nothing to repair
        return parents
    root = next((s.span_id for s in spans if s.name == semconv.ROLLOUT_SPAN), None)
    for span_id, parent in parents.items():
        if parent in missing:
            parents[span_id] = root if root != span_id else None
    return parents


def _ancestors(span_id: str, parents: dict[str, str | None]) -> list[str]:
    lineage: list[str] = []
    seen = {span_id}
    parent = parents.get(span_id)
    while parent is not None and parent not in seen:  # a cycle in bad data must not loop forever
        seen.add(parent)
        lineage.append(parent)
        parent = parents.get(parent)
    return lineage


def _packed(value: Any, what: str, pack: Any) -> bytes:
    try:
        return pack(value)
    except RecordError:
        raise Skip("malformed_span", f"malformed span: {what} is not a packed array or a list") from None


# Adapter stats: calls stored with a rollout that are not the policy's, so never sampled.
SKIPPED_JUDGE_CALLS = "calls/skipped_judge"  # purpose "judge"
SKIPPED_OTHER_CALLS = "calls/skipped_other_purpose"  # any other purpose but "policy"
_POLICY = (None, semconv.PURPOSE_POLICY)


def find_llm_calls(spans: Sequence[SpanLike], parents: dict[str, str | None], config: AdapterConfig,
                   stats: dict[str, int] | None = None) -> list[LlmCall]:
    """The policy's LLM calls among ``spans``, in time order. A call made for another purpose (a
    judge's: `semconv.CALL_PURPOSE`) is never one; ``stats`` counts them (`SKIPPED_JUDGE_CALLS`)."""
    call_spans = _policy_call_spans(spans, config, stats)
    if not call_spans:
        return []
    agent_match = re.compile(config.agent_match) if config.agent_match else None
    by_id = {s.span_id: s for s in spans} if agent_match is not None else {}
    call_ids = {s.span_id for s in call_spans}
    calls: list[LlmCall] = []
    responses: set[str] = set()
    if len(call_spans) > 1:
        call_spans.sort(key=_call_order)
        call_spans = _last_per_call_key(call_spans)
    # A call has a call among its ancestors only if some call is some span's parent: the usual trace
    # (every call under the agent's or the root span) needs no walk up the tree at all.
    nested = not call_ids.isdisjoint(parents.values())
    for s in call_spans:
        attributes = s.attributes
        if nested or agent_match is not None:
            lineage = _ancestors(s.span_id, parents)
            if not call_ids.isdisjoint(lineage):
                continue  # the same call seen by two layers (client and proxy): keep the outer one
            if agent_match is not None and not any(agent_match.search(by_id[a].name) for a in lineage):
                continue
        response_id = attributes.get(semconv.GEN_AI_RESPONSE_ID)
        if type(response_id) is str and response_id:
            if response_id in responses:
                continue
            responses.add(response_id)
        request, answer = attributes.get(semconv.REQUEST_JSON), attributes.get(semconv.RESPONSE_JSON)
        request, answer = request if type(request) is str else "", answer if type(answer) is str else ""
        if semconv.PROMPT_TOKEN_IDS not in attributes or semconv.RESPONSE_TOKEN_IDS not in attributes:
            calls.append(_retokenized_call(s, request, answer, config))
            continue
        calls.append(LlmCall(s, *_token_arrays(attributes), None, request, answer))
    return calls


def _token_arrays(attributes: dict[str, Any]) -> tuple[bytes, bytes, bytes]:
    """A call's prompt ids, response ids and log-probabilities, packed; `Skip` if they do not fit."""
    prompt = attributes[semconv.PROMPT_TOKEN_IDS]
    response = attributes[semconv.RESPONSE_TOKEN_IDS]
    logprobs = attributes.get(semconv.RESPONSE_LOGPROBS) or b""
    # planes, as the proxy writes them: nothing to do (`_packed` checks and converts the rest)
    if type(prompt) is not bytes or not tokens.is_planes(prompt):
        prompt = _packed(prompt, "prompt token ids", tokens.pack_ids)
    if type(response) is not bytes or not tokens.is_planes(response):
        response = _packed(response, "response token ids", tokens.pack_ids)
    if type(logprobs) is not bytes or len(logprobs) % 4:
        logprobs = _packed(logprobs, "logprobs", tokens.pack_floats)
    if len(logprobs) != len(response) - 1:  # 4 bytes a token each, and the planes' last byte
        raise Skip("malformed_span",
                   f"malformed span: {len(logprobs) // 4} logprobs for {len(response) // 4} response tokens")
    return prompt, response, logprobs


def _policy_call_spans(spans: Sequence[SpanLike], config: AdapterConfig, stats: dict[str, int] | None
                       ) -> list[SpanLike]:
    if config.llm_call_match:
        name_match = re.compile(config.llm_call_match)
        call_spans = [s for s in spans if name_match.search(s.name)]
    else:
        kind, llm_call = semconv.SPAN_KIND, semconv.KIND_LLM_CALL
        call_spans = [s for s in spans if s.attributes.get(kind) == llm_call]
    purpose = semconv.CALL_PURPOSE
    policy = [s for s in call_spans if s.attributes.get(purpose) in _POLICY]
    if len(policy) < len(call_spans) and stats is not None:
        _count_other_purposes(call_spans, stats)
    return policy


def _count_other_purposes(call_spans: Sequence[SpanLike], stats: dict[str, int]) -> None:
    for s in call_spans:
        purpose = s.attributes.get(semconv.CALL_PURPOSE)
        if purpose not in _POLICY:
            name = SKIPPED_JUDGE_CALLS if purpose == semconv.PURPOSE_JUDGE else SKIPPED_OTHER_CALLS
            stats[name] = stats.get(name, 0) + 1


def _retokenized_call(span: SpanLike, request: str, answer: str, config: AdapterConfig) -> LlmCall:
    """A call recorded without token ids, tokenized from its text by ``config.retokenize``; without
    one, `Skip`."""
    if config.retokenize is None:
        fidelity = span.attributes.get(semconv.TOKEN_FIDELITY, "unknown")
        raise Skip("no_token_ids", f"LLM call {span.name!r} has no token ids (token fidelity {fidelity}; "
                                   "for SFT on such calls give the adapter the policy's --tokenizer-dir)")
    prompt_ids, response_ids = config.retokenize(request, answer)
    response = tokens.pack_ids(response_ids)
    return LlmCall(span, tokens.pack_ids(prompt_ids), response, bytes(4 * len(response_ids)), None, request, answer,
                   retokenized=True)


def _last_per_call_key(call_spans: list[SpanLike]) -> list[SpanLike]:
    """The spans in order, less those whose call key (a client's retries of one call) a later span
    carries too: the proxy stores a retry once, but spans written otherwise may repeat a call."""
    last: dict[str, int] = {}
    for i, s in enumerate(call_spans):
        key = s.attributes.get(semconv.CALL_KEY)
        if type(key) is str and key:
            last[key] = i
    if len(last) == 0:
        return call_spans
    kept = []
    for i, s in enumerate(call_spans):
        key = s.attributes.get(semconv.CALL_KEY)
        if type(key) is not str or not key or last[key] == i:
            kept.append(s)
    return kept


def _finite_number(value: Any) -> bool:
    # exact float or int first (what decoding gives); a bool is not a reward
    if type(value) is not float and type(value) is not int and (
            isinstance(value, bool) or not isinstance(value, int | float)):
        return False
    return math.isfinite(value)


def match_rewards(spans: Sequence[SpanLike], calls: list[LlmCall]) -> float | None:
    """Give each reward to the most recent earlier call without one; return the final reward."""
    rewards = []
    for s in spans:
        attributes = s.attributes
        if attributes.get(semconv.SPAN_KIND) == semconv.KIND_REWARD or s.name == semconv.REWARD_SPAN:
            value = attributes.get(semconv.REWARD)
            if not _finite_number(value):
                raise Skip("malformed_span", f"malformed span: reward {value!r} is not a finite number")
            rewards.append((_time(s.start_time), s.sequence_id, float(value)))
    if not rewards:
        return None
    # (time, sequence id, 0 for a call / 1 for a reward, payload); sequence ids are unique, so the
    # first two decide the order
    events = [(_time(c.span.end_time), c.span.sequence_id, 0, c) for c in calls]
    events += [(t, seq, 1, value) for t, seq, value in rewards]
    events.sort(key=_FIRST_TWO)
    seen_calls: list[LlmCall] = []
    for _, _, is_reward, payload in events:
        if not is_reward:
            seen_calls.append(payload)
            continue
        for call in reversed(seen_calls):
            if call.reward is None:
                call.reward = payload
                break
    return max(rewards)[2]


def _trajectories(calls: list[LlmCall]) -> list[list[int]]:
    """Indices of calls joined by token-prefix match: each next prompt extends the sequence so far."""
    chains: list[list[int]] = []
    previous: LlmCall | None = None
    for i, call in enumerate(calls):
        # the prompt extends the previous call's prompt and response (compared in place, not joined)
        if previous is not None and tokens.starts_with(call.prompt, previous.prompt) and tokens.starts_with(
                call.prompt, previous.response, len(previous.prompt) // 4):
            chains[-1].append(i)
        else:
            chains.append([i])
        previous = call
    return [c for c in chains if len(c) > 1]


def _joined(calls: list[LlmCall], chain: list[int], reward: float) -> tuple[LlmCall, bytes]:
    """The calls of ``chain`` as one call rewarded ``reward``, and its response mask: the first prompt,
    then each response and what the environment said before the next (masked out, log-probability 0);
    the last call's span (its model version) and JSON."""
    first, last = calls[chain[0]], calls[chain[-1]]
    responses, logprobs = [first.response], first.logprobs
    mask = b"\x01" * (len(first.response) // 4)
    sequence_len = len(first.prompt) // 4 + len(first.response) // 4  # in ids
    for j in chain[1:]:
        c = calls[j]
        added = tokens.tail(c.prompt, sequence_len)  # what the environment said between the turns
        responses += (added, c.response)
        logprobs += bytes(4 * (len(added) // 4)) + c.logprobs  # float32 0.0 is four zero bytes
        mask += b"\x00" * (len(added) // 4) + b"\x01" * (len(c.response) // 4)
        sequence_len = len(c.prompt) // 4 + len(c.response) // 4
    retokenized = any(calls[j].retokenized for j in chain)
    joined = LlmCall(last.span, first.prompt, tokens.joined(responses), logprobs, reward, last.request_json,
                     last.response_json, retokenized)
    return joined, mask


def sample_fields(spans: Iterable[SpanLike], info: AttemptInfo, config: AdapterConfig | None = None,
                  stats: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """The samples of one attempt's spans as `Sample` fields (token arrays as packed bytes), ready for
    `fulmen.records.pack_sample`; or `Skip` with the reason. ``stats``: counts the calls left out for
    their purpose (`find_llm_calls`), also when the attempt is skipped."""
    samples = wire_samples(spans, info, config, stats)
    for fields in samples:
        del fields["v"], fields["kind"]
    return samples


def wire_samples(spans: Iterable[SpanLike], info: AttemptInfo, config: AdapterConfig | None = None,
                 stats: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """`sample_fields` as whole wire records: each map the schema version ``v`` and the ``kind``, then
    the fields, so `fulmen.codec.pack` makes of it the bytes `fulmen.records.pack_sample` makes of the
    fields (the adapter's path: no second map per sample)."""
    config = config or AdapterConfig()
    unique = dedupe(spans, info.attempt_id)
    parents = repaired_parents(unique)
    calls = find_llm_calls(unique, parents, config, stats)
    if not calls:
        raise Skip("no_llm_call", "no LLM call")
    last_reward = match_rewards(unique, calls)  # the per-call rewards need the spans
    final = info.reward if info.reward is not None else last_reward
    if final is None:
        raise Skip("no_reward", "no reward")
    rollout_id, attempt_id, group_key = info.rollout_id, info.attempt_id, info.group_key
    mode, group_size = info.mode, info.group_size
    version, kind = SCHEMA_VERSION, Sample.KIND

    def sample(sample_id: str, shape: str, first: int, call: LlmCall, mask: bytes, turns: int) -> dict[str, Any]:
        # a dict literal in `Sample`'s field order: the wire bytes are those `Sample.to_wire` writes
        return {
            "v": version, "kind": kind,
            "sample_id": sample_id, "shape": shape, "rollout_id": rollout_id, "attempt_id": attempt_id,
            "group_key": group_key, "turn_index": first,
            "prompt_token_ids": call.prompt, "response_token_ids": call.response,
            "response_logprobs": call.logprobs, "response_mask": mask,
            "reward": call.reward, "final_reward": final,
            "model_version": call.span.attributes.get(semconv.MODEL_VERSION), "mode": mode,
            "group_size": group_size, "num_turns": turns,
            "request_json": call.request_json, "response_json": call.response_json,
            "retokenized": call.retokenized,
        }

    samples = [
        sample(f"{attempt_id}/t{i}", "triplet", i, c, b"\x01" * (len(c.response) // 4), 1)
        for i, c in enumerate(calls)
    ]
    if config.trajectories and len(calls) > 1:
        for chain in _trajectories(calls):
            joined, mask = _joined(calls, chain, final)
            samples.append(sample(f"{attempt_id}/traj{chain[0]}", "trajectory", chain[0], joined, mask, len(chain)))
    return samples


def spans_to_samples(spans: Iterable[SpanLike], info: AttemptInfo, config: AdapterConfig | None = None
                     ) -> list[Sample]:
    """The samples of one attempt's spans, or `Skip` with the reason."""
    return [Sample(**fields) for fields in sample_fields(spans, info, config)]


@dataclass(slots=True)
class Adapted:
    """One rollout adapted: its records (samples, or one skip) and the counters they add."""

    rollout_id: str
    records: list[bytes]
    stats: dict[str, int]
    model_version: str = ""  # that served the last LLM call: stored with the rollout (dashboard filter)
