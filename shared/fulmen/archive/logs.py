"""The experiment's logs in the archive: the trainer's steps, the resources log, the validation passes
and the dead letters, each stream's entries as they are (id and fields).

No consumer group reads these streams, so none is added: the cursor is the archive itself (the last
id its files hold), and each pass writes what came after it. Each pass also records that id in the
store (`Keys.archived`), so `fulmen trim` keeps what is not archived yet. Why: docs/design/store.md.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fulmen.archive.files import chunk_name, last_archived, write_file
from fulmen.store.redis.stream import entry_id_text
from fulmen.store.redis.stream_ids import format_id
from fulmen.store.redis_store import RedisStore

# archive kind -> the `fulmen.keys.Keys` attribute of its stream
LOGS = {"steps": "trainer_steps", "resources": "resources_log", "validations": "validations",
        "dead-letters": "dead_letters"}


def log_record(entry_id: str, fields: dict[bytes, bytes]) -> list[Any]:
    """One archived entry: ``[id, {field: value}]``, the field names as text."""
    return [entry_id, {name.decode(): value for name, value in fields.items()}]


async def archive_logs(store: RedisStore, directory: Path, chunk: int) -> tuple[dict[str, int], list[Path]]:
    """Write every log's entries after the last one archived; the entries written per kind, and the files."""
    counts: dict[str, int] = {}
    files: list[Path] = []
    for kind, attribute in LOGS.items():
        counts[kind] = await _archive_log(store, directory, kind, getattr(store.keys, attribute), chunk, files)
    return counts, files


async def _archive_log(store: RedisStore, directory: Path, kind: str, key: str, chunk: int, files: list[Path]) -> int:
    done = last_archived(directory, kind, 0)
    start = "-" if done is None else "(" + format_id(done)
    written = 0
    while entries := await store.redis.xrange(key, min=start, count=chunk):
        records = [log_record(entry_id_text(eid), fields) for eid, fields in entries]
        first, last = records[0][0], records[-1][0]
        header = {"kind": kind, "experiment": store.experiment, "shard": 0, "first": first, "last": last,
                  "count": len(records), "written": time.time()}
        path = directory / chunk_name(kind, 0, first, last)
        write_file(path, header, records)
        files.append(path)
        written += len(records)
        start = "(" + last
        await store.redis.hset(store.keys.archived, key, last)  # after the file: trim may take up to it
    if not written:  # nothing new: the files' last id, or none yet ("0-0": trim keeps all that comes)
        await store.redis.hset(store.keys.archived, key, "0-0" if done is None else format_id(done))
    return written
