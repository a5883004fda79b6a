"""Retention: trim what every consumer group has acknowledged, by age or by count.

Nothing unconsumed is ever trimmed. An entry counts as consumed when every consumer group of its
stream has been delivered it and acknowledged it; a stream with no group is never trimmed by age or
count, because no one has read it yet.

- The queue: entries the runners group acknowledged (each was claimed, or dead-lettered).
- The finished stream: entries every group acknowledged (the adapter and the algorithm have them).
  With them go the spans of their rollouts, and, with ``delete_rollouts``, the rollouts and attempts too.
"""

from __future__ import annotations

from dataclasses import dataclass

from fulmen import keys as k
from fulmen.errors import InvalidInput, RecordError
from fulmen.records import RolloutFinished
from fulmen.records.status import TERMINAL_ROLLOUT
from fulmen.store.redis_store import RedisStore
from fulmen.store.streams import StreamId, consumed_below, format_id, parse_id

TRIM_BATCH = 500  # finished entries whose rollouts are cleaned per round trip


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    max_age_s: float | None = None  # trim consumed entries older than this
    max_count: int | None = None  # keep at most this many entries per stream (consumed ones go first)
    delete_rollouts: bool = False  # also delete the trimmed finished entries' rollouts and attempts

    def __post_init__(self) -> None:
        if self.max_age_s is None and self.max_count is None:
            raise InvalidInput("a retention policy needs max_age_s or max_count")
        if self.max_age_s is not None and self.max_age_s < 0:
            raise InvalidInput("max_age_s must be >= 0")
        if self.max_count is not None and self.max_count < 0:
            raise InvalidInput("max_count must be >= 0")


@dataclass(frozen=True, slots=True)
class TrimReport:
    queue_entries: int
    finished: int
    span_streams: int
    rollouts: int


async def _policy_cut(
    store: RedisStore, stream: str, policy: RetentionPolicy, now_ms: int
) -> StreamId | None:
    """The smallest id the policy keeps (entries below it are old or surplus), or None: keep all."""
    cut: StreamId | None = None
    if policy.max_age_s is not None:
        cut = (now_ms - int(policy.max_age_s * 1000), 0)
    if policy.max_count is not None:
        newest = await store.redis.xrevrange(stream, count=policy.max_count + 1)
        if len(newest) > policy.max_count:
            # keep the newest max_count: everything up to and including the (max_count+1)-th goes
            surplus_last = parse_id(newest[-1][0])
            by_count = (surplus_last[0], surplus_last[1] + 1)
            cut = by_count if cut is None else max(cut, by_count)
    return cut


async def _consumed_cut(store: RedisStore, stream: str) -> StreamId | None:
    if not await store.redis.exists(stream):
        return None
    groups = await store.redis.xinfo_groups(stream)
    first_pending: dict[str, StreamId | None] = {}
    for g in groups:
        name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
        summary = await store.redis.xpending(stream, name)
        lowest = summary.get("min") if summary and summary.get("pending") else None
        first_pending[name] = parse_id(lowest) if lowest else None
    return consumed_below(groups, first_pending)


async def _safe_cut(store: RedisStore, stream: str, policy: RetentionPolicy, now_ms: int) -> StreamId | None:
    wanted = await _policy_cut(store, stream, policy, now_ms)
    consumed = await _consumed_cut(store, stream)
    if wanted is None or consumed is None:
        return None
    return min(wanted, consumed)


async def trim(store: RedisStore, policy: RetentionPolicy) -> TrimReport:
    """Apply the policy once. Safe to run from several processes; a crash midway loses nothing that
    was not already consumed, and the next run finishes the job (every step is idempotent)."""
    seconds, micros = await store.redis.time()
    now_ms = seconds * 1000 + micros // 1000
    keys = store.keys

    queue_cut = await _safe_cut(store, keys.queue, policy, now_ms)
    queue_trimmed = (
        await store.redis.xtrim(keys.queue, minid=format_id(queue_cut), approximate=False) if queue_cut else 0
    )

    finished_trimmed = span_streams = rollouts = 0
    cut = await _safe_cut(store, keys.finished, policy, now_ms)
    if cut is not None:
        start = "-"
        while True:
            batch = await store.redis.xrange(keys.finished, min=start, max=f"({format_id(cut)}", count=TRIM_BATCH)
            if not batch:
                break
            rollout_ids = []
            for _entry_id, fields in batch:
                try:
                    rollout_ids.append(RolloutFinished.from_wire(fields.get(b"m")).rollout_id)
                except RecordError:  # holds no rollout to clean; trimmed all the same
                    continue
            span_streams += await _delete_rollout_data(store, rollout_ids, policy.delete_rollouts)
            if policy.delete_rollouts:
                rollouts += len(rollout_ids)
            start = f"({batch[-1][0].decode()}"
        # delete the data first, then the entries: a crash in between leaves entries to redo, never orphans
        finished_trimmed = await store.redis.xtrim(keys.finished, minid=format_id(cut), approximate=False)
    return TrimReport(queue_trimmed, finished_trimmed, span_streams, rollouts)


async def _delete_rollout_data(store: RedisStore, rollout_ids: list[str], delete_rollouts: bool) -> int:
    if not rollout_ids:
        return 0
    keys = store.keys
    pipe = store.redis.pipeline(transaction=False)
    for rid in rollout_ids:
        pipe.exists(keys.spans(rid))
        # UNLINK as a raw command: a cluster pipeline's unlink() runs at once instead of queueing
        pipe.execute_command("UNLINK", keys.spans(rid), keys.span_ids(rid))
    results = await pipe.execute()
    deleted_streams = sum(int(x) for x in results[0::2])
    if delete_rollouts:
        rollouts = await store.get_rollouts(rollout_ids)
        pipe = store.redis.pipeline(transaction=False)
        for rid, rollout in zip(rollout_ids, rollouts, strict=True):
            if rollout is None or rollout.status not in TERMINAL_ROLLOUT:
                continue
            attempts = [keys.attempt(k.attempt_id(rid, n)) for n in range(1, rollout.attempt_count + 1)]
            pipe.execute_command("UNLINK", keys.rollout(rid), *attempts)
            shard = keys.shard(rid)
            pipe.zrem(shard.rollout_index, rid)
            pipe.srem(shard.status(rollout.status), rid)
        await pipe.execute()
    return deleted_streams
