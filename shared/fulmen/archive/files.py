"""Archive files: what `fulmen archive` writes and `fulmen replay` / `fulmen export` read.

Gzip-compressed msgpack, a header then one object per record, written whole under a temporary name.
The format, and why not Parquet: docs/design/store.md.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from fulmen.errors import InvalidInput
from fulmen.store.redis.stream_ids import StreamId, parse_id

FORMAT = "fulmen-archive"
VERSION = 1
# rollouts and samples (`fulmen.archive.write`), the logs (`fulmen.archive.logs`), the run state (`fulmen.archive.state`)
KINDS = ("rollouts", "samples", "steps", "resources", "validations", "dead-letters", "state")
SUFFIX = ".msgpack.gz"
TMP_PREFIX = ".tmp-"
MAX_OBJECT_BYTES = 256 * 1024 * 1024  # one record (a rollout with every span) at most
_NAME = re.compile(rf"({'|'.join(KINDS)})-s(\d+)-(\d+-\d+)_(\d+-\d+)\.msgpack\.gz")


@dataclass(frozen=True, slots=True)
class Chunk:
    path: Path
    kind: str
    shard: int
    first: StreamId
    last: StreamId


def chunk_name(kind: str, shard: int, first: str, last: str) -> str:
    return f"{kind}-s{shard}-{first}_{last}{SUFFIX}"


def list_chunks(directory: Path, kind: str | None = None) -> list[Chunk]:
    """The archive files of ``directory`` (of one kind), by kind, shard and first id."""
    if not directory.is_dir():
        return []
    chunks = []
    for path in directory.iterdir():
        m = _NAME.fullmatch(path.name)
        if m and (kind is None or m[1] == kind):
            chunks.append(Chunk(path, m[1], int(m[2]), parse_id(m[3]), parse_id(m[4])))
    return sorted(chunks, key=lambda c: (c.kind, c.shard, c.first))


def last_archived(directory: Path, kind: str, shard: int) -> StreamId | None:
    """The last entry id of one stream that ``directory`` holds (None: nothing yet)."""
    lasts = [c.last for c in list_chunks(directory, kind) if c.shard == shard]
    return max(lasts) if lasts else None


def remove_temporaries(directory: Path) -> int:
    """Delete the half-written files a crash left behind (they were never renamed into place)."""
    removed = 0
    if directory.is_dir():
        for path in directory.iterdir():
            if path.name.startswith(TMP_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
    return removed


class ArchiveWriter:
    """One archive file written atomically, a record at a time: ``with ArchiveWriter(path, header) as w:
    w.add(record)``; the file appears (renamed into place, flushed to disk) only when the block ends
    without an error, else the temporary file is removed."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path, self.header, self.count = path, header, 0
        self._tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")
        self._packer = msgpack.Packer(use_bin_type=True)

    def __enter__(self) -> ArchiveWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._raw = open(self._tmp, "wb")
        # no name, mtime=0: the same records give the same bytes (a replay file written twice is identical)
        self._out = gzip.GzipFile(filename="", fileobj=self._raw, mode="wb", compresslevel=6, mtime=0)
        self._out.write(self._packer.pack({"format": FORMAT, "version": VERSION, **self.header}))
        return self

    def add(self, record: Any) -> None:
        self._out.write(self._packer.pack(record))
        self.count += 1

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        try:
            self._out.close()
            self._raw.flush()
            if kind is None:
                os.fsync(self._raw.fileno())
        finally:
            self._raw.close()
        if kind is None:
            try:
                os.replace(self._tmp, self.path)
            except BaseException:
                self._remove_tmp()
                raise
            _fsync_dir(self.path.parent)
        else:
            self._remove_tmp()

    def _remove_tmp(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()


def write_file(path: Path, header: dict[str, Any], records: Iterable[Any]) -> int:
    """Write ``header`` and ``records`` to ``path`` atomically (`ArchiveWriter`); returns the number of records."""
    with ArchiveWriter(path, header) as writer:
        for record in records:
            writer.add(record)
    return writer.count


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_file(path: Path, kind: str | None = None) -> tuple[dict[str, Any], Iterator[Any]]:
    """(header, records) of one archive file; InvalidInput if it is not one (or not of ``kind``)."""
    try:
        stream = gzip.open(path, "rb")  # noqa: SIM115 - closed by the records generator (or on a bad header)
        unpacker = msgpack.Unpacker(stream, raw=False, strict_map_key=False, max_buffer_size=MAX_OBJECT_BYTES)
        header = next(unpacker, None)
    except (OSError, EOFError, ValueError, msgpack.UnpackException) as e:
        raise InvalidInput(f"{path} is not a Fulmen archive file: {e}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        stream.close()
        raise InvalidInput(f"{path} is not a Fulmen archive file (no {FORMAT} header)")
    if header.get("version") != VERSION:
        stream.close()
        raise InvalidInput(f"{path} is archive format version {header.get('version')!r}; this Fulmen reads {VERSION}")
    if kind is not None and header.get("kind") != kind:
        stream.close()
        raise InvalidInput(f"{path} holds {header.get('kind')!r} records, not {kind!r}")

    def records() -> Iterator[Any]:
        try:
            yield from unpacker
        except (OSError, EOFError, ValueError, msgpack.UnpackException) as e:
            raise InvalidInput(f"{path} is damaged: {e}") from None
        finally:
            stream.close()

    return header, records()


def read_header(path: Path) -> dict[str, Any]:
    """The header of one archive file (the file closed again at once)."""
    header, records = read_file(path)
    for _ in records:  # the generator's first step owns the file: run it to its `finally`
        break
    records.close()  # type: ignore[attr-defined]  # a generator
    return header


def record_count(paths: Iterable[Path]) -> int | None:
    """The records the files hold, as their headers say (a progress bar's total); None when one does
    not say (`fulmen replay --to-file` writes no count)."""
    total = 0
    for path in paths:
        count = read_header(path).get("count")
        if not isinstance(count, int):
            return None
        total += count
    return total


def files_of(source: Path, kind: str) -> list[Path]:
    """The files to read for ``source``: an archive directory's files of ``kind`` in order, or one file."""
    if source.is_dir():
        return [c.path for c in list_chunks(source, kind)]
    if source.is_file():
        return [source]
    raise InvalidInput(f"{source} does not exist")
