"""Samples: the stream from the adapter to the trainer, written once per rollout."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from fulmen import keys as k
from fulmen.codec import unpack
from fulmen.errors import RecordError
from fulmen.records import Sample, SampleSkip, Span
from fulmen.status import RolloutStatus

SampleEntry = tuple[str, Sample | SampleSkip]


@dataclass(frozen=True, slots=True)
class RolloutForSamples:
    """A finished rollout as the adapter reads it (`SamplesMixin.read_for_samples`)."""

    rollout_id: str
    status: RolloutStatus
    attempt_id: str | None
    mode: str | None
    metadata: dict[str, Any]
    input_blob: bytes  # msgpack; decoded only when the group key must be derived from the task
    spans: list[Span] | RecordError


class SamplesMixin:
    """Part of `RedisStore`: reading spans in bulk, appending samples once, reading them back."""

    redis: aioredis.Redis
    keys: k.Keys
    max_record_bytes: int
    _append_samples: AsyncScript
    _read_for_samples: AsyncScript
    dead_letter: Callable[..., Awaitable[Any]]

    async def read_for_samples(self, rollout_ids: Sequence[str]) -> list[RolloutForSamples | None]:
        """What the adapter needs of many finished rollouts, in one round trip: status, latest attempt,
        mode, metadata, input, and (for a succeeded one) its spans. None for a rollout that is gone.
        A rollout with an unreadable span gets the error instead of its spans."""
        if not rollout_ids:
            return []
        reply = await self._read_for_samples(args=[self.keys.prefix, *rollout_ids])
        out: list[RolloutForSamples | None] = []
        for rid, row in zip(rollout_ids, reply, strict=True):
            if not row:
                out.append(None)
                continue
            status, attempt_id, mode, metadata, input_blob, flat = row
            spans: list[Span] | RecordError
            try:
                spans = [
                    Span.from_wire(flat[i + 1], int(flat[i].split(b"-")[0]), self.max_record_bytes)
                    for i in range(0, len(flat), 2)
                ]
            except (RecordError, TypeError, ValueError) as e:
                spans = e if isinstance(e, RecordError) else RecordError(f"span entry unreadable: {e!r}")
            try:
                meta = unpack(metadata, self.max_record_bytes) if metadata else {}
            except RecordError:
                meta = {}
            out.append(RolloutForSamples(
                rid, RolloutStatus(status.decode()), attempt_id.decode() or None, mode.decode() or None,
                meta if isinstance(meta, dict) else {}, input_blob, spans,
            ))
        return out

    async def append_samples(
        self, batch: Sequence[tuple[str, Sequence[bytes], Mapping[str, int]]]
    ) -> list[int]:
        """For each (rollout id, sample records, counter increments): append the records and bump the
        adapter's counters, unless the rollout was sampled before — the whole batch in one step. Returns,
        per rollout, how many were appended: 0 if sampled before, -1 if the rollout is gone."""
        if not batch:
            return []
        args: list[Any] = [self.keys.prefix]
        for rollout_id, records, stats in batch:
            args += [rollout_id, len(stats)]
            for name, increment in stats.items():
                args += [name, increment]
            args += [len(records), *records]
        return [int(n) for n in await self._append_samples(args=args)]

    async def adapter_stats(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.keys.adapter_stats)
        return {key.decode(): int(value) for key, value in raw.items()}

    async def ensure_samples_group(self, group: str = k.TRAINERS_GROUP, start: str = "0") -> None:
        try:
            await self.redis.xgroup_create(self.keys.samples, group, id=start, mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def read_samples(
        self, group: str, consumer: str, count: int = 256, block_s: float | None = None, *, pending: bool = False
    ) -> list[SampleEntry]:
        """New sample entries for a consumer group (the trainer); malformed ones are dead-lettered.
        ``pending``: instead, the entries this consumer read before and has not acknowledged (after a
        restart under the same consumer name), oldest first."""
        block_ms = None if block_s is None or pending else max(1, int(block_s * 1000))
        cursor = "0" if pending else ">"
        reply = await self.redis.xreadgroup(group, consumer, {self.keys.samples: cursor}, count=count, block=block_ms)
        out: list[SampleEntry] = []
        for entry_id, fields in reply[0][1] if reply else []:
            try:
                out.append((entry_id.decode(), decode_sample(fields.get(b"m"), self.max_record_bytes)))
            except RecordError as e:
                await self.dead_letter(self.keys.samples, entry_id.decode(), str(e), fields, ack_group=group)
        return out

    async def ack_samples(self, group: str, entry_ids: Sequence[str]) -> int:
        return await self.redis.xack(self.keys.samples, group, *entry_ids) if entry_ids else 0


def decode_sample(data: bytes | None, max_bytes: int) -> Sample | SampleSkip:
    """A samples-stream entry: a `Sample` or a `SampleSkip`, told apart by the record kind."""
    value = unpack(data, max_bytes) if data is not None else None
    if isinstance(value, dict) and value.get("kind") == "sample_skip":
        return SampleSkip.from_wire(data)
    return Sample.from_wire(data, max_bytes)
