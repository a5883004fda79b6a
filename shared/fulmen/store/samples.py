"""Samples: the stream from the adapter to the trainer, written once per rollout."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from fulmen import keys as k
from fulmen.codec import packb_kept, unpack
from fulmen.errors import RecordError
from fulmen.records import RolloutForSamples, RolloutStatus, Sample, SampleSkip, SpanView
from fulmen.store.context import StoreContext
from fulmen.store.finished import split_entry_id
from fulmen.store.lua import data as data_scripts
from fulmen.store.redis.stream import Fields, Stream

SampleEntry = tuple[str, Sample | SampleSkip]
_STATUSES = {status.value.encode(): status for status in RolloutStatus}
_new_tuple = tuple.__new__  # a `RolloutForSamples` without its Python-level __new__ (one per rollout read)
DEFAULT_READ_COUNT = 256  # sample entries per read unless the trainer asks for another number


class Samples:
    """Part of the store: reading finished rollouts and their spans in bulk, appending samples
    once per rollout, and the trainers' consumer group on the samples stream."""

    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx
        self.redis = ctx.redis
        self.keys = ctx.keys
        self.max_record_bytes = ctx.max_record_bytes
        self._append_samples = ctx.script(data_scripts.APPEND_SAMPLES)
        self._read_for_samples = ctx.script(data_scripts.READ_FOR_SAMPLES)
        self._append_marked = ctx.script(data_scripts.APPEND_SAMPLES_MARKED)
        self._groups: dict[str, Stream[Sample | SampleSkip]] = {}

    def _decode(self, entry_id: str, fields: Fields) -> Sample | SampleSkip:
        return decode_sample(fields.get(b"m"), self.max_record_bytes)

    def group(self, group: str = k.TRAINERS_GROUP) -> Stream[Sample | SampleSkip]:
        """The samples stream as consumer group ``group`` (one `Stream` per group, kept)."""
        stream = self._groups.get(group)
        if stream is None:
            stream = self._groups[group] = self.ctx.stream(self.keys.samples, self._decode, group=group)
        return stream

    async def read_for_samples(self, rollout_ids: Sequence[str]) -> list[RolloutForSamples | None]:
        """What the adapter needs of many finished rollouts, in one round trip: status, latest attempt,
        mode, metadata, input, and (for a succeeded one) its spans. None for a rollout that is gone.
        A rollout with an unreadable span gets the error instead of its spans."""
        if not rollout_ids:
            return []
        span_keys = [self.keys.spans(rid).encode() for rid in rollout_ids]  # as the reply names them
        if len(self.keys.shards) == 1:
            rows, streams = await self._read_rollouts_and_spans(self.keys.prefix, rollout_ids, span_keys)
            entries_by_key: dict[bytes, Any] = dict(streams or ())
        else:  # one read per shard, each in its shard's slot
            by_shard: dict[int, list[int]] = {}
            for i, rid in enumerate(rollout_ids):
                by_shard.setdefault(self.keys.shard(rid).index, []).append(i)
            rows = [None] * len(rollout_ids)
            entries_by_key = {}
            for shard, positions in by_shard.items():
                part_rows, part_streams = await self._read_rollouts_and_spans(
                    self.keys.shards[shard].prefix, [rollout_ids[i] for i in positions],
                    [span_keys[i] for i in positions],
                )
                for i, row in zip(positions, part_rows, strict=True):
                    rows[i] = row
                entries_by_key.update(dict(part_streams or ()))
        max_bytes = self.max_record_bytes
        return [
            rollout_for_samples(rid, row, entries_by_key.get(key, ()), max_bytes) if row else None
            for rid, key, row in zip(rollout_ids, span_keys, rows, strict=True)
        ]

    async def _read_rollouts_and_spans(self, prefix: str, rollout_ids: Sequence[str], span_keys: list[bytes]) -> list[Any]:
        """[READ_FOR_SAMPLES's rows, XREAD's reply over the span streams], atomically (one MULTI) on
        one node. On a cluster the two go in one plain pipeline to the experiment's node (redis-py
        8.1's async cluster transactions fail with "attached to a different loop"): a span stored
        between the two is then read too, as it would have been a moment later; a rollout read as
        succeeded has all the spans its runner sent before it ended."""
        await self.ctx.load_scripts()
        cluster = isinstance(self.redis, RedisCluster)
        ids = [rid.encode() for rid in rollout_ids]  # bytes: redis-py passes them through, encodes the rest one call each
        for attempt in (1, 2):
            # No COUNT: every span of every stream.
            read = (b"EVALSHA", self._read_for_samples.sha, 1, prefix, *ids)
            spans = (b"XREAD", b"STREAMS", *span_keys, *([b"0"] * len(span_keys)))
            try:
                # The auto-pipeline's wire first: hiredis's replies as they are, none of redis-py's
                # per-command path (a read: sent again through the client if the connection is lost).
                replies = None if cluster else await self.ctx.pipeline.on_wire([(b"MULTI",), read, spans, (b"EXEC",)])
                if replies is not None:
                    return _executed(replies)
                pipe = self.redis.pipeline(transaction=not cluster)
                pipe.execute_command("EVALSHA", *read[1:])
                # The command name as bytes: redis-py looks its response callbacks up by the str name,
                # so this reply stays hiredis's nested lists; its XREAD callback would build a dict per
                # span entry in Python. (A cluster client refuses a bytes command name: there the
                # parsed reply is turned back.)
                pipe.execute_command("XREAD" if cluster else b"XREAD", *spans[1:])
                rows, streams = await pipe.execute()
                return [rows, _raw_streams(streams) if cluster else streams]
            except NoScriptError:  # the server restarted or flushed its scripts: load it, go again
                if attempt == 2:
                    raise
                self._read_for_samples.sha = await self.redis.script_load(self._read_for_samples.script)
        raise AssertionError("unreachable")

    async def append_samples(
        self,
        batch: Sequence[tuple[str, Sequence[bytes], Mapping[str, int]] | tuple[str, Sequence[bytes], Mapping[str, int], str]],
        *,
        ack_group: str | None = None,
        ack_entry_ids: Sequence[str] = (),
    ) -> list[int]:
        """For each (rollout id, sample records, counter increments): append the records and bump the
        adapter's counters, unless the rollout was sampled before — the whole batch in one step, which
        also acknowledges ``ack_entry_ids`` on the finished stream for ``ack_group`` (so they are
        acknowledged exactly when their effect is stored). Returns, per rollout, how many were
        appended: 0 if sampled before, -1 if the rollout is gone. An optional fourth item is the model
        version that served the rollout's last LLM call: stored with the rollout (``model_version``) in
        the same step, for the dashboard's filter."""
        if not batch and not ack_entry_ids:
            return []
        # use_bin_type=False: the records go as msgpack raw strings, the type Redis's cmsgpack reads
        # (it refuses the bin types); Lua strings are bytes either way
        payload = packb_kept(
            [[item[0], dict(item[2]), list(item[1]), *item[3:]] for item in batch], use_bin_type=False
        )
        if len(self.keys.shards) > 1:
            return await self._append_sharded(batch, payload, ack_group, ack_entry_ids)
        ack = [ack_group, *[e.encode() for e in ack_entry_ids]] if ack_group and ack_entry_ids else [""]
        replies = await self._append_samples(keys=[self.keys.prefix], args=[payload, *ack])
        return [int(n) for n in replies or []]

    async def _append_sharded(
        self, batch: Sequence[Any], payload: bytes, ack_group: str | None, ack_entry_ids: Sequence[str]
    ) -> list[int]:
        """`append_samples` with several shards: the rollouts live in their shards' slots, the
        samples stream in shard 0's, so no one script can do all of it. The once-per-rollout marker
        moves to a set beside the samples stream (appended in the same script as the samples); the
        acknowledgement follows, per shard: a crash in between redelivers entries whose samples the
        marker then skips, so nothing is appended twice or lost. A rollout is checked to exist first
        (a finished entry not yet acknowledged is never trimmed with its rollout)."""
        pipe = self.redis.pipeline(transaction=False)
        for item in batch:
            pipe.exists(self.keys.rollout(item[0]))
        exists = await pipe.execute() if batch else []
        present = [bool(e) for e in exists]
        if any(present):
            kept = packb_kept(
                [[item[0], dict(item[2]), list(item[1])] for item, ok in zip(batch, present, strict=True) if ok],
                use_bin_type=False,
            )
            counts = iter(await self._append_marked(keys=[self.keys.prefix], args=[kept]))
        else:
            counts = iter(())
        out = [int(next(counts)) if ok else -1 for ok in present]
        pipe = self.redis.pipeline(transaction=False)
        for item, n in zip(batch, out, strict=True):
            if n > 0:
                fields = {"sampled": 1, **({"model_version": item[3]} if len(item) > 3 and item[3] else {})}
                pipe.hset(self.keys.rollout(item[0]), mapping=fields)
        if ack_group and ack_entry_ids:
            by_shard: dict[int, list[str]] = {}
            for entry_id in ack_entry_ids:
                shard, raw = split_entry_id(entry_id)
                by_shard.setdefault(shard, []).append(raw)
            for shard, ids in by_shard.items():
                pipe.xack(self.keys.shards[shard].finished, ack_group, *ids)
        await pipe.execute()
        return out

    async def adapter_stats(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.keys.adapter_stats)
        return {key.decode(): int(value) for key, value in raw.items()}

    async def ensure_samples_group(self, group: str = k.TRAINERS_GROUP, start: str = "0") -> None:
        await self.group(group).ensure_group(start)

    async def read_samples(
        self, group: str, consumer: str, count: int = DEFAULT_READ_COUNT, block_s: float | None = None, *,
        pending: bool = False, after: str = "0",
    ) -> list[SampleEntry]:
        """New sample entries for a consumer group (the trainer); malformed ones are dead-lettered.
        ``pending``: instead, the entries this consumer read before and has not acknowledged (after a
        restart under the same consumer name), oldest first, from the one after ``after``: page on
        with the last id read, since entries that stay pending are returned again from "0"."""
        return await self.group(group).read(consumer, count, block_s, pending=pending, after=after)

    async def ack_samples(self, group: str, entry_ids: Sequence[str]) -> int:
        return await self.group(group).ack(entry_ids)

    async def dead_letter_samples(self, group: str, entry_id: str, reason: str) -> None:
        """Set aside a sample entry that decoded but cannot be used (a token id outside the trainer's
        vocabulary, an error while grouping it), with the reason and its raw fields, and acknowledge it."""
        entries = await self.redis.xrange(self.keys.samples, entry_id, entry_id)
        await self.group(group).dead_letter(entry_id, reason, entries[0][1] if entries else {})


def rollout_for_samples(rollout_id: str, row: Sequence[bytes], span_entries: Any, max_bytes: int) -> RolloutForSamples:
    """A rollout as the adapter sees it, from READ_FOR_SAMPLES's row (status, attempt id, mode,
    metadata, input, reward; '' for a missing field) and its span stream's raw entries. Replaying
    archived spans (`fulmen replay`) builds it here too, so a replay reads a rollout as the adapter did."""
    status, attempt_id, mode, metadata, input_blob, reward = row
    spans: list[SpanView] | RecordError = []
    if status == b"succeeded":
        spans = _span_views(span_entries, max_bytes)
    try:
        meta = unpack(metadata, max_bytes) if metadata else {}
    except RecordError:
        meta = {}
    known = _STATUSES.get(status)  # a dict lookup; the enum's own lookup says what is wrong with another
    return _new_tuple(RolloutForSamples, (
        rollout_id, known if known is not None else RolloutStatus(status.decode()), attempt_id.decode() or None,
        mode.decode() or None, meta if isinstance(meta, dict) else {}, input_blob, spans,
        float(reward) if reward else None,
    ))


def decode_sample(data: bytes | None, max_bytes: int) -> Sample | SampleSkip:
    """A samples-stream entry: a `Sample` or a `SampleSkip`, told apart by the record kind."""
    value = unpack(data, max_bytes) if data is not None else None
    if isinstance(value, dict) and value.get("kind") == "sample_skip":
        return SampleSkip.from_wire(data)
    return Sample.from_wire(data, max_bytes)


def _span_views(entries: Any, max_bytes: int) -> list[SpanView] | RecordError:
    """A span stream's XREAD entries as views, or the error if any is unreadable (the adapter then
    skips that rollout with the reason)."""
    try:
        return SpanView.from_entries(entries, max_bytes)
    except RecordError as e:
        return e


def _executed(replies: list[Any]) -> list[Any]:
    """EXEC's reply from the replies of MULTI, its commands and EXEC sent on the wire; the first error
    raised, as redis-py's transaction raises it (NOSCRIPT as `NoScriptError`)."""
    for reply in replies[:-1]:
        if isinstance(reply, Exception):  # refused as it was queued: EXEC then aborts too
            raise reply
    executed = replies[-1]
    if isinstance(executed, Exception):
        raise executed
    for reply in executed:
        if isinstance(reply, Exception):
            raise reply
    return executed


def _raw_streams(reply: Any) -> list[Any]:
    """redis-py's parsed XREAD reply (entries as (id, {field: value})) in the raw shape of hiredis's
    (``[key, [[id, [field, value, ...]], ...]]``), which `SpanView.from_entries` reads."""
    items = reply.items() if isinstance(reply, dict) else (reply or ())
    return [
        [key, [[entry_id, [x for kv in fields.items() for x in kv] if isinstance(fields, dict) else fields]
               for entry_id, fields in entries]]
        for key, entries in items
    ]
