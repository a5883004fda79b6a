"""`fulmen restore`: an experiment rebuilt from its archive in an empty experiment, so that `fulmen
status`, the dashboard and a resumed service read it as they read the original.

Every stream entry comes back under its own id; each rollout's hash, attempts, spans, status and
index as the store's scripts write them; the resources hashes from the resources log; the newest
state snapshot (`fulmen.archive.state`). What comes back and what does not: docs/design/store.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.exceptions import ResponseError

from fulmen import keys as k
from fulmen.archive import state as run_state
from fulmen.archive.files import files_of, list_chunks, read_file, read_header, record_count
from fulmen.archive.logs import LOGS
from fulmen.errors import InvalidInput, RecordError
from fulmen.progress import SILENT, Bar
from fulmen.records import ResourcesUpdate
from fulmen.records.spans import SpanView
from fulmen.store.redis.stream_ids import format_id
from fulmen.store.redis_store import RedisStore
from fulmen.store.spans import dedupe_key

log = logging.getLogger(__name__)

BATCH = 500  # commands per pipelined round trip


@dataclass(frozen=True, slots=True)
class ArchiveInfo:
    """Whose archive a directory is: the experiment and its store shard count."""

    experiment: str
    shards: int


@dataclass
class RestoreReport:
    rollouts: int = 0
    samples: int = 0
    logs: dict[str, int] = field(default_factory=dict)
    state: bool = False  # a state snapshot was put back
    groups: int = 0  # consumer groups made

    def summary(self) -> str:
        logs = ", ".join(f"{n} {kind}" for kind, n in self.logs.items())
        state = f"the run state and {self.groups} consumer groups" if self.state else "no run state (none archived)"
        return f"{self.rollouts} rollouts, {self.samples} samples, {logs}, {state}"


def archive_info(directory: Path) -> ArchiveInfo:
    """The experiment and shard count an archive directory holds; InvalidInput if it holds no archive."""
    if not directory.is_dir():
        raise InvalidInput(f"{directory} is not a directory")
    chunks = list_chunks(directory)
    if not chunks:
        raise InvalidInput(f"{directory} holds no archive files (`fulmen archive` writes them)")
    header = read_header(chunks[0].path)
    shards = next((read_header(c.path).get("shards") for c in chunks if c.kind == "rollouts"), None)
    if shards is None:
        snapshot = run_state.newest(directory)
        shards = int((snapshot or {}).get("strings", {}).get("shards_count") or 1)
    return ArchiveInfo(str(header.get("experiment")), int(shards))


async def check_empty(store: RedisStore) -> None:
    """InvalidInput unless ``store``'s experiment has no key at all (not even its name registered)."""
    redis, keys = store.redis, store.keys
    found = bool(await redis.sismember(k.EXPERIMENTS, store.experiment))
    for pattern in keys.patterns():
        async for _key in redis.scan_iter(match=pattern, count=1000):
            found = True
            break
    if found:
        raise InvalidInput(f"experiment {store.experiment} already has data: restore only into an empty "
                           "experiment (another --experiment, or delete it first with `fulmen experiments --delete`)")


async def restore(store: RedisStore, directory: Path, bar: Bar = SILENT) -> RestoreReport:
    """Rebuild the archive of ``directory`` in ``store``'s experiment, which must be empty and have
    the archive's shard count; ``bar`` moves a step per stream entry put back."""
    info = archive_info(directory)
    if len(store.keys.shards) != info.shards:
        raise InvalidInput(f"{directory} archives a store of {info.shards} shards; this store has "
                           f"{len(store.keys.shards)}")
    await check_empty(store)
    if bar.drawn:
        bar.update(total=record_count(_entry_files(directory)))
    report = RestoreReport()
    writer = _Batch(store)
    for chunk in list_chunks(directory, "rollouts"):
        _header, records = read_file(chunk.path, "rollouts")
        for record in bar.each(records):
            _rollout(writer, store.keys, chunk.shard, record)
            report.rollouts += 1
            await writer.flush_if_full()
    for path in files_of(directory, "samples"):
        for entry_id, value in bar.each(read_file(path, "samples")[1]):
            writer.pipe.xadd(store.keys.samples, {"m": value}, id=entry_id)
            report.samples += 1
            await writer.flush_if_full()
    for kind, attribute in LOGS.items():
        report.logs[kind] = await _restore_log(writer, directory, kind, getattr(store.keys, attribute), bar)
    newest = await _resources(writer, directory)
    await writer.flush()
    snapshot = run_state.newest(directory)
    if snapshot is not None:
        report.groups = await run_state.apply(store, snapshot)
        report.state = True
    await _resources_counter(store, newest)
    if info.experiment == store.experiment:
        await _archive_groups(store, directory)
    await store.redis.sadd(k.EXPERIMENTS, store.experiment)  # last: a half-done restore is not listed
    return report


def _entry_files(directory: Path) -> list[Path]:
    """The files of every stream entry a restore puts back (not the state snapshots)."""
    return [c.path for c in list_chunks(directory, "rollouts")] + [
        path for kind in ("samples", *LOGS) for path in files_of(directory, kind)]


class _Batch:
    """A pipeline that is sent every `BATCH` commands."""

    def __init__(self, store: RedisStore) -> None:
        self.redis, self.keys = store.redis, store.keys
        self.pipe = store.redis.pipeline(transaction=False)

    async def flush_if_full(self) -> None:
        if len(self.pipe) >= BATCH:
            await self.flush()

    async def flush(self) -> None:
        if len(self.pipe):
            await self.pipe.execute()
        self.pipe = self.redis.pipeline(transaction=False)


def _rollout(writer: _Batch, keys: k.Keys, shard: int, record: dict[str, Any]) -> None:
    """One archived finished entry: its rollout's keys as the store's scripts leave a finished rollout."""
    pipe, rid = writer.pipe, record.get("rollout_id")
    rollout = record.get("rollout")
    if rid and rollout:
        pipe.hset(keys.rollout(rid), mapping=rollout)
        for attempt in record.get("attempts") or []:
            pipe.hset(keys.attempt(_text(attempt["attempt_id"])), mapping=attempt)
        spans = record.get("spans") or []
        for entry_id, flat in spans:
            pipe.xadd(keys.spans(rid), dict(zip(flat[::2], flat[1::2], strict=True)), id=entry_id)
        try:
            dedupe = [dedupe_key(s) for s in SpanView.from_entries(spans)]  # type: ignore[arg-type]
        except RecordError as e:
            log.warning("rollout %s: spans restored, their dedupe keys not (%s)", rid, e)
            dedupe = []
        if dedupe:
            pipe.sadd(keys.span_ids(rid), *dedupe)
        home = keys.shard(rid)
        if rollout.get("status"):
            pipe.sadd(home.status(_text(rollout["status"])), rid)
        if rollout.get("enqueue_time"):
            pipe.zadd(home.rollout_index, {rid: float(rollout["enqueue_time"])})
    if record.get("finished") is not None:
        pipe.xadd(keys.shards[shard].finished, {"m": record["finished"]}, id=record["finished_id"])


async def _restore_log(writer: _Batch, directory: Path, kind: str, key: str, bar: Bar) -> int:
    count = 0
    for path in files_of(directory, kind):
        for entry_id, fields in bar.each(read_file(path, kind)[1]):
            writer.pipe.xadd(key, fields, id=entry_id)
            count += 1
            await writer.flush_if_full()
    return count


async def _resources(writer: _Batch, directory: Path) -> int:
    """Each resources id's hash (version -> record, and ``latest``) from the archived resources log;
    returns the newest version."""
    latest: dict[str, int] = {}
    keys = writer.keys
    for path in files_of(directory, "resources"):
        for _entry_id, fields in read_file(path, "resources")[1]:
            try:
                update = ResourcesUpdate.from_wire(fields.get("m"))
            except RecordError:
                continue  # restored in the log as it was; no hash version to give it
            writer.pipe.hset(keys.resources(update.resources_id), str(update.version), fields["m"])
            latest[update.resources_id] = max(latest.get(update.resources_id, 0), update.version)
            await writer.flush_if_full()
    for resources_id, version in latest.items():
        writer.pipe.hset(keys.resources(resources_id), "latest", version)
    return max(latest.values(), default=0)


async def _resources_counter(store: RedisStore, newest: int) -> None:
    """The version counter at least the newest version restored (the snapshot may predate it)."""
    counter = int(await store.redis.get(store.keys.resources_version) or 0)
    if newest > counter:
        await store.redis.set(store.keys.resources_version, newest)


async def _archive_groups(store: RedisStore, directory: Path) -> None:
    """The archive's own group where the archive ends, so that the next `fulmen archive` into this
    directory goes on from there."""
    ends: dict[str, str] = {}
    for chunk in list_chunks(directory, "rollouts"):
        ends[store.keys.shards[chunk.shard].finished] = format_id(chunk.last)
    for chunk in list_chunks(directory, "samples"):
        ends[store.keys.samples] = format_id(chunk.last)
    for key, last in ends.items():
        try:
            await store.redis.xgroup_create(key, k.ARCHIVE_GROUP, id=last, mkstream=True)
        except ResponseError:  # BUSYGROUP: put where the archive ends
            await store.redis.xgroup_setid(key, k.ARCHIVE_GROUP, id=last)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
