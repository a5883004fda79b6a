"""Retention: what may go from the store's streams, and `trim`, which removes it (or counts it).

Nothing a consumer group has not acknowledged is ever trimmed; `trim` is safe to interrupt and to run
concurrently. The rule per stream: docs/design/store.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fulmen.errors import InvalidInput
from fulmen.retention.cuts import (
    age_cut,
    archived_cut,
    lower,
    policy_cut,
    safe_cut,
    server_now_ms,
    trim_below,
)
from fulmen.retention.rollouts import trim_finished
from fulmen.retention.weights import trim_resources_log, trim_weights
from fulmen.store.redis_store import RedisStore

log = logging.getLogger(__name__)

QUEUE, FINISHED, SAMPLES = "queue", "finished", "samples"
CONSUMED_STREAMS = frozenset({QUEUE, FINISHED, SAMPLES})  # the streams consumer groups read
RESOURCES, WEIGHTS, STEPS, DEAD_LETTERS = "resources", "weights", "steps", "dead-letters"

# (kind, stream key, entries trimmed or to trim): called once per stream as `trim` goes
Progress = Callable[[str, str, int], None]


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    max_age_s: float | None = None  # consumed entries at least this old go
    max_count: int | None = None  # keep at most this many entries per stream (consumed ones go first)
    delete_rollouts: bool = False  # also delete the trimmed finished entries' rollouts and attempts
    streams: frozenset[str] = CONSUMED_STREAMS  # which consumed streams the two limits apply to
    resources: bool = False  # the resources log too, by the same limits (see the module docstring)
    keep_versions: int | None = None  # the weights of the newest so many versions (and served ones) stay
    weights_dir: Path | None = None  # the shared folder of folder versions, whose folders go with them
    steps_max_count: int | None = None  # the trainer's newest so many steps stay
    dead_letters_max_age_s: float | None = None  # dead letters at least this old go

    def __post_init__(self) -> None:
        object.__setattr__(self, "streams", frozenset(self.streams))  # a list or set given: still hashable
        unknown = self.streams - CONSUMED_STREAMS
        if unknown:
            raise InvalidInput(f"unknown streams {sorted(unknown)}: use {sorted(CONSUMED_STREAMS)}")
        for name in ("max_age_s", "max_count", "dead_letters_max_age_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidInput(f"{name} must be >= 0, got {value}")
        for name in ("keep_versions", "steps_max_count"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidInput(f"{name} must be >= 1 (the newest stays), got {value}")
        if self.resources and not self.limited:
            raise InvalidInput("trimming the resources log needs max_age_s or max_count")
        if not (self.limited or self.keep_versions or self.steps_max_count or self.dead_letters_max_age_s is not None):
            raise InvalidInput(
                "a retention policy needs max_age_s or max_count, keep_versions, steps_max_count or dead_letters_max_age_s"
            )

    @property
    def limited(self) -> bool:
        """Whether the age and count limits say anything (else the consumed streams stay whole)."""
        return self.max_age_s is not None or self.max_count is not None


@dataclass(frozen=True, slots=True)
class TrimReport:
    """What one `trim` removed (with ``dry_run``: would remove), summed over the shards."""

    queue_entries: int = 0
    finished: int = 0
    span_streams: int = 0  # rollouts' span streams deleted with their finished entries
    rollouts: int = 0  # rollout records deleted (with delete_rollouts)
    samples: int = 0
    resources: int = 0  # resources log entries
    weight_versions: tuple[str, ...] = ()  # model versions whose weights were deleted, oldest first
    steps: int = 0
    dead_letters: int = 0
    dry_run: bool = False
    streams: dict[str, int] = field(default_factory=dict)  # entries per stream key, every stream trimmed

    @property
    def total(self) -> int:
        """Entries and versions removed in all (span streams and rollouts go with finished entries)."""
        return (self.queue_entries + self.finished + self.samples + self.resources + len(self.weight_versions)
                + self.steps + self.dead_letters)

    def summary(self) -> str:
        verb = "would trim" if self.dry_run else "trimmed"
        versions = ", ".join(self.weight_versions) or "none"
        return (f"{verb} {self.queue_entries} queue entries, {self.finished} finished entries "
                f"({self.span_streams} span streams, {self.rollouts} rollouts), {self.samples} samples, "
                f"{self.resources} resources log entries, {self.steps} trainer steps, {self.dead_letters} "
                f"dead letters; weights of versions: {versions}")


async def trim(
    store: RedisStore, policy: RetentionPolicy, *, dry_run: bool = False, progress: Progress | None = None
) -> TrimReport:
    """Apply the policy once, over every shard and every stream it names (see the module docstring);
    with ``dry_run``, remove nothing and report what would go."""
    run = _Trimming(store, policy, dry_run, progress, await server_now_ms(store.redis))
    keys, redis = store.keys, store.redis
    queue = await run.queues()
    finished, spans, rollouts = await run.finished()
    samples = await run.samples()

    versions: list[str] = []
    if policy.keep_versions is not None:
        versions = await trim_weights(store, policy.keep_versions, policy.weights_dir, dry_run)
        run.done(WEIGHTS, keys.weights("*"), len(versions))  # one line for every version's stream
    resources = 0
    if policy.resources:
        resources = run.done(RESOURCES, keys.resources_log, await trim_resources_log(
            store, policy.max_age_s, policy.max_count, run.now_ms, dry_run, doomed_versions=versions))
    steps = 0
    if policy.steps_max_count is not None:
        cut = lower(await policy_cut(redis, keys.trainer_steps, None, policy.steps_max_count, run.now_ms),
                    await archived_cut(redis, keys.archived, keys.trainer_steps))
        steps = run.done(STEPS, keys.trainer_steps, await trim_below(redis, keys.trainer_steps, cut, dry_run))
    dead = 0
    if policy.dead_letters_max_age_s is not None:
        cut = lower(age_cut(run.now_ms, policy.dead_letters_max_age_s),
                    await archived_cut(redis, keys.archived, keys.dead_letters))
        dead = run.done(DEAD_LETTERS, keys.dead_letters, await trim_below(redis, keys.dead_letters, cut, dry_run))

    report = TrimReport(queue, finished, spans, rollouts, samples, resources, tuple(versions), steps, dead,
                        dry_run, run.per_stream)
    if report.total and not dry_run:
        log.info("retention on experiment %s: %s", store.experiment, report.summary())
    return report


@dataclass
class _Trimming:
    """One `trim` at the server's ``now_ms``: the consumed streams by the age and count limits, and
    the entries counted per stream key as it goes."""

    store: RedisStore
    policy: RetentionPolicy
    dry_run: bool
    progress: Progress | None
    now_ms: int
    per_stream: dict[str, int] = field(default_factory=dict)

    def done(self, kind: str, key: str, count: int) -> int:
        self.per_stream[key] = self.per_stream.get(key, 0) + count
        if self.progress is not None:
            self.progress(kind, key, count)
        return count

    def applies(self, stream: str) -> bool:
        return self.policy.limited and stream in self.policy.streams

    async def consumed(self, kind: str, key: str) -> int:
        redis, policy = self.store.redis, self.policy
        cut = await safe_cut(redis, key, policy.max_age_s, policy.max_count, self.now_ms)
        return self.done(kind, key, await trim_below(redis, key, cut, self.dry_run))

    async def queues(self) -> int:
        """Every shard's queue streams: the entries trimmed."""
        trimmed = 0
        if self.applies(QUEUE):
            for shard in self.store.keys.shards:
                for key in shard.queues:
                    trimmed += await self.consumed(QUEUE, key)
        return trimmed

    async def finished(self) -> tuple[int, int, int]:
        """Every shard's finished stream: the entries, span streams and rollouts trimmed."""
        finished = spans = rollouts = 0
        if self.applies(FINISHED):
            policy = self.policy
            for shard in self.store.keys.shards:
                cut = await safe_cut(self.store.redis, shard.finished, policy.max_age_s, policy.max_count, self.now_ms)
                outcome = await trim_finished(self.store, shard.finished, cut, policy.delete_rollouts, self.dry_run)
                finished += self.done(FINISHED, shard.finished, outcome.entries)
                spans, rollouts = spans + outcome.span_streams, rollouts + outcome.rollouts
        return finished, spans, rollouts

    async def samples(self) -> int:
        return await self.consumed(SAMPLES, self.store.keys.samples) if self.applies(SAMPLES) else 0

