"""Trimming one shard's finished stream, and with each entry its rollout's spans (and, when asked,
the rollout itself): the data first, then the entries, so a crash in between leaves entries to redo,
never data nobody can find."""

from __future__ import annotations

from typing import NamedTuple

from fulmen import keys as k
from fulmen.errors import RecordError
from fulmen.records import RolloutFinished
from fulmen.records.status import TERMINAL_ROLLOUT
from fulmen.store.redis.stream_ids import StreamId, format_id
from fulmen.store.redis_store import RedisStore

TRIM_BATCH = 500  # finished entries whose rollouts are cleaned per round trip


class FinishedTrim(NamedTuple):
    entries: int
    span_streams: int
    rollouts: int


async def trim_finished(
    store: RedisStore, stream: str, cut: StreamId | None, delete_rollouts: bool, dry_run: bool
) -> FinishedTrim:
    """Remove the entries of finished stream ``stream`` below ``cut`` (every group acknowledged them:
    the caller's cut says so), their rollouts' spans, and with ``delete_rollouts`` the terminal
    rollouts' records. With ``dry_run``, count what would go."""
    if cut is None:
        return FinishedTrim(0, 0, 0)
    entries = span_streams = rollouts = 0
    start = "-"
    while True:
        batch = await store.redis.xrange(stream, min=start, max=f"({format_id(cut)}", count=TRIM_BATCH)
        if not batch:
            break
        entries += len(batch)
        rollout_ids = []
        for _entry_id, fields in batch:
            try:
                rollout_ids.append(RolloutFinished.from_wire(fields.get(b"m")).rollout_id)
            except RecordError:  # holds no rollout to clean; trimmed all the same
                continue
        if dry_run:
            spans, gone = await _count_rollout_data(store, rollout_ids, delete_rollouts)
        else:
            spans, gone = await _delete_rollout_data(store, rollout_ids, delete_rollouts)
        span_streams, rollouts = span_streams + spans, rollouts + gone
        last = batch[-1][0]
        start = "(" + (last.decode() if isinstance(last, bytes) else last)
    if not dry_run:
        entries = int(await store.redis.xtrim(stream, minid=format_id(cut), approximate=False))
    return FinishedTrim(entries, span_streams, rollouts)


async def _count_rollout_data(store: RedisStore, rollout_ids: list[str], delete_rollouts: bool) -> tuple[int, int]:
    if not rollout_ids:
        return 0, 0
    pipe = store.redis.pipeline(transaction=False)
    for rid in rollout_ids:
        pipe.exists(store.keys.spans(rid))
    spans = sum(int(x) for x in await pipe.execute())
    if not delete_rollouts:
        return spans, 0
    rollouts = await store.rollouts.get_rollouts(rollout_ids)
    return spans, sum(1 for r in rollouts if r is not None and r.status in TERMINAL_ROLLOUT)


async def _delete_rollout_data(store: RedisStore, rollout_ids: list[str], delete_rollouts: bool) -> tuple[int, int]:
    """Delete the rollouts' spans (and records): returns (span streams, rollouts) deleted."""
    if not rollout_ids:
        return 0, 0
    keys = store.keys
    pipe = store.redis.pipeline(transaction=False)
    for rid in rollout_ids:
        pipe.exists(keys.spans(rid))
        # UNLINK as a raw command: a cluster pipeline's unlink() runs at once instead of queueing
        pipe.execute_command("UNLINK", keys.spans(rid), keys.span_ids(rid))
    results = await pipe.execute()
    deleted_streams = sum(int(x) for x in results[0::2])
    deleted_rollouts = 0
    if delete_rollouts:
        rollouts = await store.rollouts.get_rollouts(rollout_ids)
        pipe = store.redis.pipeline(transaction=False)
        for rid, rollout in zip(rollout_ids, rollouts, strict=True):
            if rollout is None or rollout.status not in TERMINAL_ROLLOUT:
                continue
            attempts = [keys.attempt(k.attempt_id(rid, n)) for n in range(1, rollout.attempt_count + 1)]
            pipe.execute_command("UNLINK", keys.rollout(rid), *attempts)
            shard = keys.shard(rid)
            pipe.zrem(shard.rollout_index, rid)
            pipe.srem(shard.status(rollout.status), rid)
            if len(keys.shards) > 1:  # the once-sampled marker of a sharded experiment (shard 0's set)
                pipe.srem(keys.sampled, rid)
            deleted_rollouts += 1
        await pipe.execute()
    return deleted_streams, deleted_rollouts
