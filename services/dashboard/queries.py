"""What the dashboard's pages read beyond the live frame (`fulmen.telemetry.pipeline`) and the rollout
pages (`fulmen.store.browse`): one rollout with its attempts and span tree, the curves, the
validations, dead letters, the newest finished rollouts. Every read names its keys; none scans the
keyspace, none writes."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from fulmen import keys as k
from fulmen.errors import NotFound, RecordError
from fulmen.records import Attempt, DeadLetter, Rollout, RolloutFinished, Span
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.telemetry.llm_calls import LlmCall, describe, is_llm_call
from fulmen.telemetry.steps import decode_steps

# The curves the curves page draws: (label, TrainStep metric keys, the first present wins).
CURVES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train reward", ("rollout/reward_mean",)),
    ("loss", ("loss/total",)),
    ("KL", ("loss/kl",)),
    ("entropy", ("loss/entropy",)),
    ("tokens/s", ("perf/tokens_per_s",)),
    ("compression ratio", ("comm/ratio", "comm/compression_ratio")),
)
STEP_FIELDS = {"rollout/reward_mean": "reward_mean", "loss/total": "loss"}  # metrics a TrainStep also holds
CURVE_STEPS = 2000  # the newest steps the curves show unless asked for more (the stream keeps 10,000)
VALIDATIONS_READ = 1000  # validation passes a page reads (newest)
MAX_SPANS = 5000  # of one rollout shown: a runaway agent's millions would not fit a page anyway
RECENT_FINISHED = 10
SCORE_KEY = re.compile(r"(pass|maj)@\d+")  # a validation pass's k-sample scores: pass@2, maj@4


@dataclass
class SpanNode:
    span: Span
    children: list[SpanNode] = field(default_factory=list)
    call: LlmCall | None = None  # set for an LLM call

    @property
    def kind(self) -> str:
        return str(self.span.attributes.get(semconv.SPAN_KIND, ""))

    @property
    def duration_ms(self) -> float | None:
        s = self.span
        return None if s.start_time is None or s.end_time is None else (s.end_time - s.start_time) * 1000


@dataclass
class AttemptView:
    attempt: Attempt
    roots: list[SpanNode]
    llm_calls: int
    spans: int


@dataclass
class RolloutView:
    rollout: Rollout
    model_version: str | None
    attempts: list[AttemptView]
    truncated: bool  # more spans than MAX_SPANS


def span_tree(spans: list[Span]) -> list[SpanNode]:
    """Spans as a forest: children under their parent, in sequence order; a span whose parent was
    not recorded is a root."""
    nodes = {s.span_id: SpanNode(s, call=describe(s.attributes) if is_llm_call(s.attributes) else None) for s in spans}
    roots = []
    for s in spans:
        parent = nodes.get(s.parent_id) if s.parent_id else None
        if parent is None or parent is nodes[s.span_id]:
            roots.append(nodes[s.span_id])
        else:
            parent.children.append(nodes[s.span_id])
    return roots


async def rollout_view(store: RedisStore, rollout_id: str) -> RolloutView:
    """NotFound if the rollout is not in the experiment."""
    rollout = await store.rollouts.get_rollout(rollout_id)
    attempts = await store.rollouts.query_attempts(rollout_id)
    spans = await store.spans.query_spans(rollout_id, limit=MAX_SPANS + 1)
    truncated = len(spans) > MAX_SPANS
    spans = spans[:MAX_SPANS]
    raw = await store.redis.hget(store.keys.rollout(rollout_id), "model_version")
    views = []
    for attempt in attempts:
        own = [s for s in spans if s.attempt_id == attempt.attempt_id]
        views.append(AttemptView(attempt, span_tree(own), sum(1 for s in own if is_llm_call(s.attributes)), len(own)))
    return RolloutView(rollout, raw.decode() if raw else None, views, truncated)


async def experiment_exists(store: RedisStore) -> bool:
    return bool(await store.redis.sismember(k.EXPERIMENTS, store.experiment))


async def validations(store: RedisStore) -> list[dict[str, Any]]:
    """The validation passes, oldest first, one per label (a pass run twice counts once)."""
    return await store.validations.passes(newest=VALIDATIONS_READ)


async def run_config(store: RedisStore) -> dict[str, Any] | None:
    """The run's effective settings and run file as the algorithm stored them (None: no run recorded
    them, or the record is unreadable)."""
    raw = await store.redis.get(store.keys.run_config)
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("settings"), dict) else None


def _version_number(result: dict[str, Any]) -> int | None:
    for name in ("step", "version"):
        value = result.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    label = str(result.get("label", ""))
    return int(label[1:]) if label[:1] == "v" and label[1:].isdigit() else None


async def curves(store: RedisStore, last: int = CURVE_STEPS) -> dict[str, Any]:
    """The curves of the newest ``last`` steps as columns for the charts: x (steps) and one y list
    per curve (None: no value), and the validation accuracy per model version."""
    by_step = {s.step: s for s in decode_steps(list(reversed(await store.redis.xrevrange(store.keys.trainer_steps,
                                                                                       count=last))))}
    steps = [by_step[n] for n in sorted(by_step)]  # a restarted trainer repeats steps: the later entry counts
    series: dict[str, list[float | None]] = {}
    for label, names in CURVES:
        values = []
        for s in steps:
            value = next((s.metrics[n] for n in names if n in s.metrics), None)
            if value is None and names[0] in STEP_FIELDS:  # the record's own fields, for older steps
                value = getattr(s, STEP_FIELDS[names[0]])
            values.append(value)
        series[label] = values
    return {"steps": [s.step for s in steps], "series": series, "validation": _validation_curve(await validations(store))}


def _validation_curve(passes: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Accuracy per model version, and each pass@j / maj@k a pass of k samples per task recorded (None
    for a version whose pass has no such score)."""
    points = sorted(
        (v, i) for i, r in enumerate(passes)
        if (v := _version_number(r)) is not None and isinstance(r.get("accuracy"), int | float)
    )
    curve: dict[str, list[Any]] = {"version": [v for v, _ in points],
                                   "accuracy": [float(passes[i]["accuracy"]) for _, i in points]}
    for key in score_columns([passes[i] for _, i in points]):
        curve[key] = [_score(passes[i].get(key)) for _, i in points]
    return curve


def _score(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def score_columns(passes: list[dict[str, Any]]) -> list[str]:
    """The pass@j and maj@k keys the passes hold (passes of k > 1 samples per task), pass@ first, each
    by increasing j: the extra columns of the validation table and the extra validation curves."""
    def order(key: str) -> tuple[int, int]:
        family, _, j = key.partition("@")
        return (0 if family == "pass" else 1), int(j)

    return sorted({key for r in passes for key in r if SCORE_KEY.fullmatch(key)}, key=order)


async def dead_letters(store: RedisStore, limit: int) -> list[DeadLetter]:
    letters = []
    for entry_id, fields in await store.redis.xrevrange(store.keys.dead_letters, count=limit):
        try:
            letters.append(DeadLetter.from_wire(fields.get(b"m"), dead_letter_id=entry_id.decode()))
        except RecordError:
            continue
    return letters


async def recent_finished(store: RedisStore) -> list[RolloutFinished]:
    """The newest finished rollouts, newest first, of every store shard."""
    entries = []
    for shard in store.keys.shards:
        entries += await store.redis.xrevrange(shard.finished, count=RECENT_FINISHED)
    entries.sort(key=lambda e: tuple(int(x) for x in e[0].split(b"-")), reverse=True)
    out = []
    for entry_id, fields in entries[:RECENT_FINISHED]:
        try:
            out.append(RolloutFinished.from_wire(fields.get(b"m"), entry_id=entry_id.decode()))
        except RecordError:
            continue
    return out


async def must_exist(store: RedisStore) -> None:
    if not await experiment_exists(store):
        raise NotFound(f"experiment {store.experiment} does not exist")
