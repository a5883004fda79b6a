"""`fulmen archive`: an experiment's finished rollouts (with their attempts and spans) and its samples,
written to files (`fulmen.archive.files`) before retention trims them; with them, each pass, the logs
(`fulmen.archive.logs`) and the run's state (`fulmen.archive.state`).

An entry is acknowledged only once its file is in place: nothing is lost or archived twice.
Why: docs/design/store.md.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.exceptions import ResponseError

from fulmen import keys as k
from fulmen.archive.files import (
    chunk_name,
    last_archived,
    list_chunks,
    read_header,
    remove_temporaries,
    write_file,
)
from fulmen.archive.logs import archive_logs
from fulmen.archive.state import archive_state
from fulmen.errors import InvalidInput, RecordError
from fulmen.progress import SILENT, Bar
from fulmen.records import RolloutFinished
from fulmen.store.redis.stream_ids import StreamId, parse_id
from fulmen.store.redis_store import RedisStore

CONSUMER = "archiver"
DEFAULT_CHUNK = 1000  # entries per file (and per round trip)


@dataclass
class ArchiveReport:
    rollouts: int = 0
    samples: int = 0
    files: list[Path] = field(default_factory=list)
    recovered: int = 0  # entries a crash left written but unacknowledged: acknowledged now, not rewritten
    logs: dict[str, int] = field(default_factory=dict)  # entries archived per log (`fulmen.archive.logs.LOGS`)
    state: Path | None = None  # the run state's snapshot, when it changed since the last one

    def summary(self) -> str:
        """One line of what the pass archived."""
        logs = ", ".join(f"{n} {kind}" for kind, n in self.logs.items())
        state = "a new state snapshot" if self.state is not None else "the state unchanged"
        note = f"; {self.recovered} entries a crashed run had written, acknowledged" if self.recovered else ""
        return (f"{self.rollouts} rollouts and {self.samples} samples, {logs}, {state}, "
                f"in {len(self.files)} file(s){note}")


async def archive(store: RedisStore, directory: Path, *, chunk: int = DEFAULT_CHUNK, samples: bool = True,
                  bar: Bar = SILENT) -> ArchiveReport:
    """Write everything the archive group has not taken yet to ``directory``, shard by shard; ``bar``
    moves a step per finished or samples entry (the logs, short, are not counted)."""
    if chunk < 1:
        raise InvalidInput("chunk must be at least 1")
    _check_directory(directory, store.experiment)
    directory.mkdir(parents=True, exist_ok=True)
    remove_temporaries(directory)
    report = ArchiveReport()
    streams = [("rollouts", shard.index, shard.finished) for shard in store.keys.shards]
    streams += [("samples", 0, store.keys.samples)] if samples else []
    if bar.drawn:
        bar.update(total=await _backlog(store.redis, [key for _, _, key in streams]))
    # the state first: every rollout it counts as done has finished, so this pass archives it too
    report.state = await archive_state(store, directory)
    if report.state is not None:
        report.files.append(report.state)
    for kind, shard, key in streams:
        bar.update(what=f"archive {kind}")
        await _archive_stream(store, directory, (kind, shard, key), chunk, report, bar)
    bar.update(what="archive logs")
    report.logs, files = await archive_logs(store, directory, chunk)
    report.files += files
    return report


def _check_directory(directory: Path, experiment: str) -> None:
    if directory.exists() and not directory.is_dir():
        raise InvalidInput(f"{directory} is not a directory")
    chunks = list_chunks(directory)
    if chunks:
        header = read_header(chunks[0].path)
        if header.get("experiment") != experiment:
            raise InvalidInput(f"{directory} archives experiment {header.get('experiment')!r}, not {experiment!r}: "
                               "use one directory per experiment")


async def _backlog(redis: Any, keys: list[str]) -> int | None:
    """The entries of these streams the archive group has not acknowledged: every entry before its
    first pass, after it its lag and pending (Redis 7); None where Redis cannot say (Redis 6)."""
    total = 0
    for key in keys:
        try:
            groups = await redis.xinfo_groups(key)
        except ResponseError:  # no such stream yet
            continue
        group = next((g for g in groups if _text(g.get("name")) == k.ARCHIVE_GROUP), None)
        if group is None or _text(group.get("last-delivered-id")) == "0-0":
            total += await redis.xlen(key)
        elif group.get("lag") is None:
            return None
        else:
            total += int(group["lag"]) + int(group.get("pending") or 0)
    return total


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _archive_stream(store: RedisStore, directory: Path, stream: tuple[str, int, str], chunk: int,
                          report: ArchiveReport, bar: Bar) -> None:
    """Archive one stream ((kind, shard, key)): first what a crashed pass left pending, then what is new."""
    kind, shard, key = stream
    redis = store.redis
    with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists (the cursor of an earlier run)
        await redis.xgroup_create(key, k.ARCHIVE_GROUP, id="0", mkstream=True)
    done = last_archived(directory, kind, shard)
    for start in ("0", ">"):  # first what a crashed run left pending, then what is new
        while True:
            entries = await _read(redis, key, start, chunk)
            if not entries:
                break
            read = len(entries)
            if start == "0" and done is not None:
                old = [eid for eid, _ in entries if parse_id(eid) <= done]
                if old:
                    await redis.xack(key, k.ARCHIVE_GROUP, *old)
                    report.recovered += len(old)
                entries = [(eid, f) for eid, f in entries if parse_id(eid) > done]
            done = await _write(store, directory, kind, shard, entries, report) or done
            if entries:
                await redis.xack(key, k.ARCHIVE_GROUP, *[eid for eid, _ in entries])
            bar.advance(read)
            if start == ">" and len(entries) < chunk:
                break


async def _read(redis: Any, key: str, start: str, count: int) -> list[tuple[str, dict[bytes, bytes]]]:
    reply = await redis.xreadgroup(k.ARCHIVE_GROUP, CONSUMER, {key: start}, count=count)
    streams = reply.items() if isinstance(reply, dict) else (reply or ())
    out = []
    for _key, entries in streams:
        for entry_id, fields in entries:
            eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            out.append((eid, fields or {}))  # a pending entry trimmed meanwhile has no fields
    return out


async def _write(
    store: RedisStore, directory: Path, kind: str, shard: int, entries: list[tuple[str, dict[bytes, bytes]]],
    report: ArchiveReport,
) -> StreamId | None:
    """One file of ``entries`` (those that still have data); the last id written, or None."""
    live = [(eid, f) for eid, f in entries if f]
    if not live:
        return None
    first, last = live[0][0], live[-1][0]
    if kind == "rollouts":
        records = await _rollout_records(store, live)
        report.rollouts += len(records)
    else:
        records = [[eid, f.get(b"m")] for eid, f in live]
        report.samples += len(records)
    header = {"kind": kind, "experiment": store.experiment, "shard": shard, "shards": len(store.keys.shards),
              "first": first, "last": last, "count": len(records), "written": time.time()}
    path = directory / chunk_name(kind, shard, first, last)
    write_file(path, header, records)
    report.files.append(path)
    return parse_id(last)


async def _rollout_records(store: RedisStore, entries: list[tuple[str, dict[bytes, bytes]]]) -> list[dict[str, Any]]:
    """Per finished entry: the entry, its rollout's hash, its attempts' hashes and its span stream."""
    keys = store.keys
    rollout_ids: list[str | None] = []
    for _eid, fields in entries:
        try:
            rollout_ids.append(RolloutFinished.from_wire(fields.get(b"m")).rollout_id)
        except RecordError:  # archived as it is, with no rollout to go with it
            rollout_ids.append(None)
    present = [rid for rid in rollout_ids if rid is not None]
    pipe = store.redis.pipeline(transaction=False)
    for rid in present:
        pipe.hgetall(keys.rollout(rid))
        pipe.xrange(keys.spans(rid))
    replies = iter(await pipe.execute() if present else [])
    hashes: dict[str, dict[bytes, bytes]] = {}
    spans: dict[str, list[Any]] = {}
    for rid in present:
        hashes[rid], spans[rid] = next(replies), next(replies)
    pipe = store.redis.pipeline(transaction=False)
    wanted = []
    for rid in present:
        for n in range(1, int(hashes[rid].get(b"attempt_n") or 0) + 1):
            pipe.hgetall(keys.attempt(k.attempt_id(rid, n)))
            wanted.append(rid)
    attempts: dict[str, list[dict[str, bytes]]] = {}
    for rid, attempt in zip(wanted, await pipe.execute() if wanted else [], strict=True):
        if attempt:
            attempts.setdefault(rid, []).append(_text_keys(attempt))
    records = []
    for (eid, fields), rid in zip(entries, rollout_ids, strict=True):
        rollout = hashes.get(rid) if rid is not None else None
        records.append({
            "finished_id": eid,
            "finished": fields.get(b"m"),
            "rollout_id": rid,
            "rollout": _text_keys(rollout) if rollout else None,
            "attempts": attempts.get(rid, []) if rid is not None else [],
            # as XREAD's raw reply has them: `SpanView.from_entries` reads this shape
            "spans": [[sid, [x for kv in f.items() for x in kv]] for sid, f in spans.get(rid, [])] if rid else [],
        })
    return records


def _text_keys(fields: dict[bytes, bytes]) -> dict[str, bytes]:
    return {name.decode(): value for name, value in fields.items()}
