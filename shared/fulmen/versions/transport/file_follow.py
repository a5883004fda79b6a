"""Reading a model version's file in the shared folder while the trainer writes it.

`FileReadAhead`: nothing read is used before a resources entry names that very file with its sha256.
Why: docs/design/model-versions.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import mmap
import os
import struct
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fulmen.errors import RecordError
from fulmen.versions.blobs import TensorSpan, layout, open_regular
from fulmen.versions.manifest import HASH_THREADS, read_manifest
from fulmen.versions.transport.file_spares import WEIGHTS_FILE
from fulmen.versions.transport.stream import _hash_and_check, check_tensors

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.05  # how often the folder is looked at for the next version's file
GROW_POLL_S = 0.01  # how often a file being written is looked at for new tensors
MAP_STEP_BYTES = 32 << 20  # new tensors' bytes worth a new memory map of the file (or the file's end)
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


class FileReadAhead:
    """Follows ``<folder>/<version>``'s weights file as it is written, from construction on (a task
    of the running loop), until `take` or `close`. ``stall_s``: a file that has not grown for this
    long is a publish that stopped."""

    def __init__(self, folder: Path, version: str, stall_s: float, threads: int = HASH_THREADS) -> None:
        self.folder, self.version, self.stall_s = Path(folder) / version, version, stall_s
        self.fd: int | None = None
        self.spans: list[TensorSpan] | None = None  # the first header's layout, sorted by end
        self.submitted = 0  # spans handed to the pool
        self.jobs: list[tuple[TensorSpan, Future[tuple[str, bool]]]] = []
        self.pool = ThreadPoolExecutor(threads)
        self.task: asyncio.Task[bool] = asyncio.ensure_future(self._follow())
        self.task.add_done_callback(_quiet)

    async def _follow(self) -> bool:
        """True once every tensor is being hashed; False when the file stopped growing before."""
        loop = asyncio.get_running_loop()
        while (fd := _open(self.folder)) is None:
            await asyncio.sleep(WAIT_POLL_S)
        self.fd = fd
        grew_at, seen = loop.time(), -1
        while True:
            size = os.fstat(fd).st_size
            if size != seen:
                grew_at, seen = loop.time(), size
            self._feed(fd, size)
            if self.spans is not None and self.submitted == len(self.spans):
                return True
            if loop.time() - grew_at > self.stall_s:
                return False
            await asyncio.sleep(GROW_POLL_S)

    def _feed(self, fd: int, size: int) -> None:
        """Learn the layout once the header is in, then hash the tensors the file holds entirely."""
        if self.spans is None:
            if size < 8:
                return
            (header_size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            if header_size > MAX_HEADER_BYTES:
                raise RecordError(f"model version {self.version}: a header of {header_size:,} bytes")
            if size < 8 + header_size:
                return
            header = os.pread(fd, 8 + header_size, 0)
            self.spans = sorted(layout(self.version, header, 8 + header_size + (1 << 62)), key=lambda s: s.end)
        ready = self.submitted
        while ready < len(self.spans) and self.spans[ready].end <= size:
            ready += 1
        if ready == self.submitted:
            return
        pending = self.spans[ready - 1].end - self.spans[self.submitted].start
        if pending < MAP_STEP_BYTES and ready < len(self.spans):
            return  # a few more tensors first: one map for many small ones
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # copy on write: never written, so no copy
        for span in self.spans[self.submitted : ready]:
            self.jobs.append((span, self.pool.submit(_hash_and_check, mapped, span)))
        self.submitted = ready

    async def take(self, weights: Mapping[str, Any]) -> tuple[mmap.mmap, str, str] | None:
        """The version's file as `fulmen.versions.model_version.fetch_version` takes it pre-read — a memory
        map, its sha256, ``"manifest"`` (every tensor checked) — if ``weights`` (the announced entry)
        names the file read and it checks out; else None. Closes this read-ahead either way."""
        try:
            path, sha256 = weights.get("path"), weights.get("sha256")
            if not isinstance(path, str) or not isinstance(sha256, str):
                return None
            if self.fd is None:  # whole before it was looked for (small, or written over a spare)
                self.task.cancel()
                self.fd = open_regular(Path(path))
                if self.fd is None:
                    return None
                self._feed(self.fd, os.fstat(self.fd).st_size)
                if self.spans is None or self.submitted < len(self.spans):
                    return None  # shorter than its header says: the usual read says so
            # else the file must be the one followed, and whole (renamed into place after its last
            # write): what is left is hashing
            elif not self._reads(Path(path)) or not await asyncio.wait_for(asyncio.shield(self.task), self.stall_s):
                return None
            # the check's own descriptor: a cancelled take closes this one while the thread may run
            return await asyncio.to_thread(self._checked, os.dup(self.fd), sha256, list(self.jobs))
        except Exception as e:  # read again the usual way, which says what is wrong if anything is
            log.warning("reading model version %s while it was written failed (%r): reading it again", self.version, e)
            return None
        finally:
            self.close()

    def _reads(self, path: Path) -> bool:
        """Whether ``path`` is the file being read (renamed or not, the same inode)."""
        if self.fd is None:
            return False
        try:
            named = os.stat(path)
        except OSError:
            return False
        mine = os.fstat(self.fd)
        return (named.st_ino, named.st_dev) == (mine.st_ino, mine.st_dev)

    def _checked(self, fd: int, sha256: str, jobs: list[tuple[TensorSpan, Future[tuple[str, bool]]]]
                 ) -> tuple[mmap.mmap, str, str] | None:
        """The file as served, if it is the version announced with ``sha256`` and checks out."""
        assert self.spans is not None
        try:
            mapped = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        header_size = struct.unpack("<Q", mapped[:8])[0]
        header = bytes(mapped[: 8 + min(header_size, len(mapped))])
        manifest = read_manifest(header, self.version)
        if hashlib.sha256(header).hexdigest() != sha256 or manifest is None or not manifest.covers_blob():
            return None  # another header (a delta's blob is hashed whole: read the usual way)
        if sorted(layout(self.version, mapped), key=lambda s: s.end) != self.spans:
            raise RecordError(f"model version {self.version}: its header declares another layout than the one read")
        check_tensors(self.version, manifest, [(span, *job.result()) for span, job in jobs])
        return mapped, sha256, "manifest"

    def close(self) -> None:
        """Stop following; the hashes under way end on their own (their maps go with them)."""
        self.task.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.jobs = []
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def _open(folder: Path) -> int | None:
    """A read-only descriptor of the folder's weights file, as it is written (never one written over
    a spare, ``.recycled``: its size says nothing of what is written) or once renamed; None when
    there is neither (yet)."""
    for name in (WEIGHTS_FILE + ".partial", WEIGHTS_FILE):
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            fd = open_regular(folder / name)
            if fd is not None:
                return fd
    return None


def _quiet(task: asyncio.Future[Any]) -> None:
    """A read-ahead nobody took: its outcome is not worth a log line."""
    if not task.cancelled():
        task.exception()
