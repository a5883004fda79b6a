"""`fulmen replay`: archived or live spans → samples again, by the live adapter's own code.

Entry point `replay`; it must stay idempotent per replay name. Why: docs/design/adapter.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fulmen.archive.files import ArchiveWriter, files_of, read_file
from fulmen.errors import RecordError
from fulmen.records import RolloutFinished, RolloutForSamples
from fulmen.records.status import TERMINAL_ROLLOUT
from fulmen.store import RedisStore
from fulmen.store.replayed import ReplayWriter
from fulmen.store.samples import rollout_for_samples
from fulmen_adapter.adapter import adapt_rollout
from fulmen_adapter.triplets import Adapted, AdapterConfig

BATCH = 128  # rollouts per read (live) and per append
# The rollout hash fields the adapter reads, in READ_FOR_SAMPLES's order (`fulmen.store.lua.data`).
ROW_FIELDS = ("status", "attempt_id", "mode", "metadata", "input", "reward")


@dataclass
class ReplayReport:
    rollouts: int = 0  # rollouts adapted
    samples: int = 0  # sample records made (skips not counted)
    skipped: int = 0  # rollouts that yielded a skip record
    appended: int = 0  # records appended to the samples stream (0 for rollouts this replay appended before)


def archived_rollouts(source: Path, max_bytes: int) -> Iterator[RolloutForSamples]:
    """The rollouts of an archive directory (or one file of it), in archive order. A rollout that was
    already gone when archived, or not terminal, is left out (the adapter would not adapt it)."""
    for path in files_of(source, "rollouts"):
        _header, records = read_file(path, "rollouts")
        for record in records:
            if not isinstance(record, dict):
                continue
            rid, fields = record.get("rollout_id"), record.get("rollout")
            if not isinstance(rid, str) or not isinstance(fields, dict):
                continue
            row = [fields.get(name, b"") for name in ROW_FIELDS]
            if not all(isinstance(x, bytes) for x in row):
                continue
            rollout = rollout_for_samples(rid, row, record.get("spans") or [], max_bytes)
            if rollout.status in TERMINAL_ROLLOUT:
                yield rollout


async def live_rollouts(store: RedisStore) -> AsyncIterator[list[RolloutForSamples]]:
    """The terminal rollouts whose finished entries are still in Redis, every shard, in batches."""
    for shard in store.keys.shards:
        start = "-"
        while True:
            entries = await store.redis.xrange(shard.finished, min=start, count=BATCH)
            if not entries:
                break
            start = "(" + entries[-1][0].decode()
            ids = []
            for _eid, fields in entries:
                try:
                    ids.append(RolloutFinished.from_wire(fields.get(b"m")).rollout_id)
                except RecordError:
                    continue
            rows = await store.samples.read_for_samples(list(dict.fromkeys(ids)))
            yield [r for r in rows if r is not None and r.status in TERMINAL_ROLLOUT]


async def _batched(rollouts: Iterator[RolloutForSamples]) -> AsyncIterator[list[RolloutForSamples]]:
    batch: list[RolloutForSamples] = []
    for rollout in rollouts:
        batch.append(rollout)
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


async def replay(
    store: RedisStore | None, source: Path | None, config: AdapterConfig, max_bytes: int, *,
    to_file: Path | None = None, name: str = "replay",
) -> ReplayReport:
    """Replay ``source`` (an archive; None: the live spans of ``store``) into ``to_file``, or into the
    samples stream under the replay ``name``."""
    if store is None and (source is None or to_file is None):
        raise ValueError("a replay from or to Redis needs a store")
    rollouts = _batched(archived_rollouts(source, max_bytes)) if source is not None else live_rollouts(store)  # type: ignore[arg-type]
    if to_file is None:
        return await _replay(rollouts, config, max_bytes, ReplayWriter(store, name).append)  # type: ignore[arg-type]
    header = {"kind": "samples", "experiment": store.experiment if store else None, "shard": 0,
              "source": str(source) if source else "live"}
    with ArchiveWriter(to_file, header) as file:
        async def add(batch: list[tuple[str, list[bytes]]]) -> list[int]:
            for _rid, records in batch:
                for record in records:
                    file.add(["", record])
            return [0] * len(batch)

        return await _replay(rollouts, config, max_bytes, add)


async def _replay(
    rollouts: AsyncIterator[list[RolloutForSamples]], config: AdapterConfig, max_bytes: int,
    write: Callable[[list[tuple[str, list[bytes]]]], Awaitable[list[int]]],
) -> ReplayReport:
    report = ReplayReport()
    seen: set[str] = set()
    async for batch in rollouts:
        results: list[Adapted] = []
        for rollout in batch:
            if rollout.rollout_id in seen:
                continue
            seen.add(rollout.rollout_id)
            results.append(adapt_rollout(rollout, config, max_bytes))
        for result in results:
            report.rollouts += 1
            if "skipped" in result.stats:
                report.skipped += 1
            else:
                report.samples += len(result.records)
        report.appended += sum(await write([(r.rollout_id, r.records) for r in results]))
    return report
