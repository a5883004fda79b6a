"""Reading a model version's chunks from Redis, checked while they arrive.

Entry point `read_stream` (into a buffer the caller chooses); `BlobChecker.finish` raises RecordError
on any difference. How reading and hashing overlap: docs/design/model-versions.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from redis.exceptions import ResponseError

from fulmen.errors import RecordError
from fulmen.records import WeightsChunk
from fulmen.versions.blobs import DATA_FIELD, TensorSpan, layout, tensor_is_finite, view
from fulmen.versions.manifest import HASH_THREADS, Manifest, TensorEntry, read_manifest
from fulmen.versions.transport.socket import ChunkSocket

if TYPE_CHECKING:
    import mmap

    from fulmen.store import RedisStore

    Buffer = bytearray | mmap.mmap

log = logging.getLogger(__name__)

READ_PAGE_BYTES = 32 << 20  # chunks per XRANGE page: bounded client buffers, hashing starts early
PAGES_AHEAD = 2  # XRANGE pages in flight at once (read_stream)


class BlobChecker:
    """Checks a blob's bytes while they arrive (see the module docstring). Call `feed` with the
    bytes filled so far, then `finish` once they all are."""

    def __init__(self, version: str, sha256: str | None, threads: int = HASH_THREADS) -> None:
        self.version, self.sha256 = version, sha256
        self.pool = ThreadPoolExecutor(threads)
        self.manifest: Manifest | None = None
        self.spans: list[TensorSpan] | None = None  # None until the header is in; sorted by end
        self.by_manifest = False
        self.started = 0  # spans handed to the pool
        self.jobs: list[tuple[TensorSpan, Future[tuple[str, bool]]]] = []
        self.whole: Any = None  # the blob's running sha256 when there is no manifest to check against
        self.hashed = 0
        self.serial: Future[None] | None = None

    def feed(self, blob: Buffer, filled: int) -> None:
        if self.spans is None:
            if filled < 8:
                return
            (size,) = struct.unpack("<Q", blob[:8])
            if 8 + size > filled and 8 + size <= len(blob):
                return
            self._start(blob)
        assert self.spans is not None
        if self.by_manifest:
            while self.started < len(self.spans) and self.spans[self.started].end <= filled:
                span = self.spans[self.started]
                self.jobs.append((span, self.pool.submit(_hash_and_check, blob, span)))
                self.started += 1
        elif filled > self.hashed:
            # in order: each piece waits for the one before it (a one-item chain of futures)
            self.serial = self.pool.submit(_update, self.serial, self.whole, memoryview(blob)[self.hashed : filled])
            self.hashed = filled

    def _start(self, blob: Buffer) -> None:
        from fulmen.versions.blobs import _header_size

        header = bytes(blob[: 8 + _header_size(self.version, blob)])
        self.manifest = read_manifest(header, self.version)
        self.by_manifest = (self.manifest is not None and self.manifest.covers_blob()
                            and self.sha256 is not None and hashlib.sha256(header).hexdigest() == self.sha256)
        if self.by_manifest:
            self.spans = sorted(layout(self.version, blob), key=lambda s: s.end)
        else:
            self.spans, self.whole = [], hashlib.sha256()

    def finish(self, blob: Buffer) -> str | None:
        """Wait for the checks; RecordError on a difference. ``"manifest"`` or ``"whole"``: what was
        proved (`fulmen.versions.blobs.deserialize`); None when nothing was (a header never complete)."""
        try:
            if self.spans is None:
                return None
            self.feed(blob, len(blob))
            if not self.by_manifest:
                if self.serial is not None:
                    self.serial.result()
                actual = self.whole.hexdigest()
                if self.sha256 is not None and actual != self.sha256:
                    raise RecordError(f"model version {self.version} is corrupt: sha256 {actual[:12]}… "
                                      f"expected {self.sha256[:12]}…")
                return "whole"
            assert self.manifest is not None
            check_tensors(self.version, self.manifest, [(span, *job.result()) for span, job in self.jobs])
            return "manifest"
        finally:
            self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.jobs, self.serial = [], None  # their views of the blob: a memory map closes only without them


def check_tensors(version: str, manifest: Manifest, hashed: list[tuple[TensorSpan, str, bool]]) -> None:
    """RecordError unless the blob's tensors, each hashed as (span, sha256, finite), are exactly the
    manifest's: the same names, each with its dtype, shape and sha256, and finite."""
    names = {span.name for span, _, _ in hashed}
    if names != set(manifest.tensors):
        extra, missing = sorted(names - set(manifest.tensors)), sorted(set(manifest.tensors) - names)
        raise RecordError(f"model version {version}: its tensors are not its manifest's "
                          f"(not in the manifest: {extra[:3]}, missing: {missing[:3]})")
    broken = []
    for span, digest, finite in hashed:
        entry = manifest.tensors[span.name]
        got = TensorEntry(str(span.dtype).removeprefix("torch."), tuple(span.shape), digest)
        if got != entry:
            what = "sha256" if (got.dtype, got.shape) == (entry.dtype, entry.shape) else "dtype or shape"
            raise RecordError(f"model version {version} is corrupt: {span.name} does not match "
                              f"its manifest's {what}")
        if not finite:
            broken.append(span.name)
    if broken:
        raise RecordError(f"model version {version} holds NaN or infinite values in {broken[:5]}: refused")


def check_whole(version: str, blob: Buffer, sha256: str | None) -> str | None:
    """`BlobChecker` over a blob that is all there (a memory-mapped file): the tensors hashed in
    parallel threads, their finiteness checked in the same pass."""
    checker = BlobChecker(version, sha256)
    try:
        checker.feed(blob, len(blob))
    except BaseException:
        checker.close()
        raise
    return checker.finish(blob)


def _hash_and_check(blob: Buffer, span: TensorSpan) -> tuple[str, bool]:
    digest = hashlib.sha256(memoryview(blob)[span.start : span.end]).hexdigest()
    return digest, tensor_is_finite(view(blob, span))


def _update(before: Future[None] | None, digest: Any, piece: memoryview) -> None:
    if before is not None:
        before.result()
    digest.update(piece)


class _Assembly:
    """The blob being put together from a stream's chunks, each checked to be the next one before its
    bytes go in."""

    def __init__(self, store: RedisStore, version: str, key: str, allocate: Callable[[int], Buffer],
                 check: bool) -> None:
        self.version, self.key, self.allocate, self.check = version, key, allocate, check
        self.max_record_bytes = store.max_record_bytes
        self.first: WeightsChunk | None = None
        self.blob: Buffer | None = None
        self.checker: BlobChecker | None = None
        self.read = self.filled = 0  # chunks, bytes
        self.placing = 0  # the length of the chunk being received

    def place(self, m: Any, length: int, inline: bool = False) -> memoryview:
        """Where the next chunk's ``length`` bytes go, once its record ``m`` shows it is the next chunk
        of this blob and they fit; `commit` once they are there. ``inline``: the bytes are inside the
        record (older writers)."""
        chunk = WeightsChunk.from_wire(m, self.max_record_bytes)
        if chunk.data and not inline:
            raise RecordError(f"model version {self.version}: chunk {chunk.index} holds its bytes twice")
        if self.first is None:
            _check_first(self.version, self.key, chunk, length)  # before its size is allocated
            self.first, self.blob = chunk, self.allocate(chunk.size)
            self.checker = BlobChecker(self.version, chunk.sha256) if self.check else None
        first = self.first
        found = (chunk.model_version, chunk.index, chunk.total, chunk.sha256, chunk.size)
        if found != (self.version, self.read, first.total, first.sha256, first.size):
            raise RecordError(
                f"model version {self.version}: expected chunk {self.read} of {first.total} on {self.key}, "
                f"found chunk {chunk.index} of {chunk.total}: a chunk is missing or foreign"
            )
        if self.filled + length > first.size:
            raise RecordError(f"model version {self.version}: its chunks hold more than {first.size:,} bytes")
        assert self.blob is not None
        self.placing = length
        return memoryview(self.blob)[self.filled : self.filled + length]

    def commit(self) -> None:
        """The chunk `place` gave room to is in."""
        self.filled += self.placing
        self.read += 1

    def add(self, m: Any, data: bytes | None) -> None:
        """A chunk received as bytes (``data`` None: they are inside its record)."""
        inline = data is None
        if data is None:
            data = WeightsChunk.from_wire(m, self.max_record_bytes).data
        with self.place(m, len(data), inline) as target:
            target[:] = data
        self.commit()

    def done(self) -> bool:
        return self.first is not None and self.read >= self.first.total


def _check_first(version: str, key: str, chunk: WeightsChunk, length: int) -> None:
    """RecordError unless ``chunk`` (``length`` bytes) can be the first of the blob it describes. A
    writer cuts a blob into chunks as long as the first but the last, which may be shorter
    (`fulmen.versions.blobs.write_stream`), so ``size`` lies in ((total - 1) × length, total × length]:
    a ``total`` or ``size`` out of it cannot be true, and would have the reader allocate or ask for
    what is not there."""
    if (chunk.model_version, chunk.index) != (version, 0):
        raise RecordError(f"model version {version}: expected chunk 0 on {key}, found chunk {chunk.index} "
                          f"of {chunk.model_version}: a chunk is missing or foreign")
    total, size = chunk.total, chunk.size
    if not (size == length if total == 1 else (total - 1) * length < size <= total * length):
        raise RecordError(f"model version {version}: its first chunk on {key} holds {length:,} bytes and "
                          f"declares {total:,} chunks of {size:,} bytes in all, which cannot be true: refused")


async def read_stream(store: RedisStore, version: str, allocate: Callable[[int], Buffer] = bytearray,
                      check: bool = True, follow_s: float | None = None) -> tuple[Buffer, str, str | None] | None:
    """The blob on the version's weights stream, copied into ``allocate(size)``, its sha256 as the
    chunks state it, and what was checked on the way (`BlobChecker.finish`; None with ``check``
    False); None if the stream has no chunk; RecordError if chunks are missing, out of place or do
    not check out, as soon as a page comes back short or the first chunk declares a total or size it
    cannot have: what a read costs is bounded by the chunks there, not by what they declare.

    ``follow_s``: read the stream while it is being written (a prefetch, before any resources entry
    names the version): wait as long as it takes for the first chunk, then at most ``follow_s``
    seconds for each next one; None if one does not come in time (the publish stopped). Nothing read
    this way may be served before a resources entry names the version (`ModelFollower`).

    After the first chunk, the pages come on a connection of the reader's own, straight into the blob
    (`fulmen.versions.transport.socket`), where one can be opened like the client's."""
    reader = _StreamReader(store, version, allocate, check, follow_s)
    try:
        return await reader.read()
    finally:
        reader.close()


class _StreamReader:
    """One `read_stream`: the chunks asked for page by page, through redis-py or on a connection of the
    reader's own, put together in an `_Assembly`."""

    def __init__(self, store: RedisStore, version: str, allocate: Callable[[int], Buffer], check: bool,
                 follow_s: float | None) -> None:
        self.store, self.version, self.follow_s = store, version, follow_s
        self.key = store.keys.weights(version)
        self.blob = _Assembly(store, version, self.key, allocate, check)
        self.raw: ChunkSocket | None = None  # the reader's own connection, once opened (None again if it fails)
        self.own: ThreadPoolExecutor | None = None  # the own connection's thread, drained before returning
        self.opened: list[ChunkSocket] = []
        self.page, self.sized = 1, False  # chunks per page: one until the first chunk shows the chunk size
        # Pages after the first ask for exact id ranges (chunk i is entry 0-<i+1>), PAGES_AHEAD at a time
        # (on as many connections, or pipelined on the reader's own): the server builds the next replies
        # while the client parses this one (one round trip at a time left one side idle).
        # Each page asked and not read yet, with the chunks it must bring: a page that brings fewer ends
        # the read (the chunks are not there, whatever the first one declared).
        self.pages: deque[tuple[asyncio.Future[Any], int]] = deque()
        self.raw_pages: deque[int] = deque()  # the same on the own connection
        self.asked = 0  # chunks requested so far
        self.gave_up = False  # a follow waited in vain for the next chunk

    async def read(self) -> tuple[Buffer, str, str | None] | None:
        blob = self.blob
        while not blob.done():
            if self.raw is not None:  # after the first chunk, on the reader's own connection
                step = await self._own_page()
                if step == "end":
                    break
                if step == "next":
                    continue
                # "behind": a follow ahead of the writer: wait for its next chunk below, then back to this connection
            entries, expected = await self._client_page()
            for _, fields in entries:
                blob.add(fields.get(b"m"), fields.get(DATA_FIELD.encode()))
            if expected is not None:
                self._whole_page(expected, len(entries))
            if not entries:
                break
            _feed(blob)
            if blob.first is not None and not self.sized and not blob.done():
                await self._open_own()
        return None if self.gave_up else await self._result()

    def _ask(self) -> None:
        """Ask for the next page: pipelined on the own connection, or a request of redis-py's."""
        assert self.blob.first is not None
        low, high = f"0-{self.asked + 1}", f"0-{self.asked + self.page}"
        expected = min(self.page, self.blob.first.total - self.asked)
        if self.raw is not None:
            self.raw.send("XRANGE", self.key, low, high, "COUNT", self.page)
            self.raw_pages.append(expected)
        else:
            self.pages.append((asyncio.ensure_future(
                self.store.weights_redis.xrange(self.key, min=low, max=high, count=self.page)), expected))
        self.asked += self.page

    def _whole_page(self, expected: int, got: int) -> None:
        """RecordError if a page brought fewer chunks than it asked for: they are not on the stream, and
        no later page can bring them (a first chunk that overstates the total ends here)."""
        if got < expected:
            first = self.blob.first
            assert first is not None
            raise RecordError(f"model version {self.version} is incomplete: {self.blob.read:,} of {first.total:,} "
                              f"chunks on {self.key}, and a page of {expected:,} more found {got:,}")

    async def _own_page(self) -> Literal["next", "end", "behind"]:
        """One page on the own connection, received in its thread: ``"next"`` once it is in (or once the
        connection failed: redis-py goes on); ``"end"`` when every chunk was asked for and read and some
        never came; ``"behind"`` when a follow found no new chunk (the writer is behind)."""
        blob, raw, own = self.blob, self.raw, self.own
        assert blob.first is not None and raw is not None and own is not None
        if self.follow_s is not None:
            self.asked = blob.read  # one page at a time from what is read: the writer may be behind
        before = blob.read
        try:
            while len(self.raw_pages) < (PAGES_AHEAD if self.follow_s is None else 1) and self.asked < blob.first.total:
                self._ask()
            if not self.raw_pages:  # every chunk asked for and read, and some never came
                return "end"
            expected = self.raw_pages.popleft()
            got = await asyncio.wrap_future(own.submit(raw.entries, blob))
        except (OSError, ResponseError) as e:
            # a restart, a dropped connection: on through redis-py, which rides out an outage
            log.warning("reading model version %s on its own connection failed (%r): going on with the "
                        "client's", self.version, e)
            raw.close()
            self.raw, self.asked = None, blob.read
            self.raw_pages.clear()
            return "next"
        _feed(blob)
        if self.follow_s is None:  # a follow's page may be short: the writer is behind
            self._whole_page(expected, got)
            return "next"
        return "next" if blob.read > before else "behind"

    async def _client_page(self) -> tuple[list[Any], int | None]:
        """The next entries through redis-py: while following, the next ones written; else the first
        chunk alone, then the pages asked for, PAGES_AHEAD in flight. Empty when no more come. With
        them, how many a page asked for must bring (`_whole_page`); None for a follow or the first."""
        first = self.blob.first
        if self.follow_s is not None:
            wait_s = None if first is None else self.follow_s
            entries = await _written_next(self.store, self.key, self.blob.read, self.page, wait_s)
            self.gave_up = not entries
            return entries, None
        if first is None:
            return await self.store.weights_redis.xrange(self.key, min="0-1", max="+", count=1), None
        while len(self.pages) < PAGES_AHEAD and self.asked < first.total:
            self._ask()
        if not self.pages:  # every chunk asked for, and some never came
            return [], None
        page, expected = self.pages.popleft()
        return await page, expected

    async def _open_own(self) -> None:
        """Once the first chunk shows the chunk size: pages of about READ_PAGE_BYTES, and the reader's
        own connection, opened in its thread (None where it cannot be opened like the client's)."""
        first = self.blob.first
        assert first is not None
        self.sized = True
        self.page, self.asked = max(1, READ_PAGE_BYTES // max(1, first.size // first.total)), self.blob.read
        self.own = ThreadPoolExecutor(1, thread_name_prefix="fulmen-weights")
        self.raw = await asyncio.wrap_future(self.own.submit(self._connect))

    def _connect(self) -> ChunkSocket | None:
        reader = ChunkSocket.open(self.store.weights_redis)
        if reader is not None:
            self.opened.append(reader)
        return reader

    async def _result(self) -> tuple[Buffer, str, str | None] | None:
        """The blob once every chunk is in, checked (see `read_stream`)."""
        blob, first = self.blob, self.blob.first
        if first is None or blob.blob is None:
            return None
        if blob.read != first.total:
            raise RecordError(f"model version {self.version} is incomplete: {blob.read} of {first.total} chunks "
                              f"on {self.key}")
        if blob.filled != first.size:
            raise RecordError(f"model version {self.version} is {blob.filled:,} bytes, expected {first.size:,}")
        if blob.checker is None:
            return blob.blob, first.sha256, None
        finishing, blob.checker = blob.checker, None
        return blob.blob, first.sha256, await asyncio.to_thread(finishing.finish, blob.blob)

    def close(self) -> None:
        """What a read leaves behind, whether it ended or was left early (a bad chunk, a cancel)."""
        for pending, _ in self.pages:  # left early: the pages on their way are not wanted
            pending.cancel()
        for reader in self.opened:
            reader.close()  # wakes the own thread if it waits on the socket
        if self.own is not None:
            # its thread may still be writing into the blob (a cancelled read): done before the caller
            # reuses or unmaps it
            self.own.shutdown(wait=True)
        if self.blob.checker is not None:  # left early: the pool's pending hashes are dropped
            self.blob.checker.close()


def _feed(blob: _Assembly) -> None:
    if blob.checker is not None and blob.blob is not None:
        blob.checker.feed(blob.blob, blob.filled)


FOLLOW_POLL_MS = 1000  # one blocking read at a time, so a cancelled prefetch ends within this


async def _written_next(store: RedisStore, key: str, read: int, count: int, wait_s: float | None) -> list[Any]:
    """The next chunks after the first ``read`` of a stream being written, blocking until at least one
    is there; waits forever while ``wait_s`` is None, else gives up (``[]``) after ``wait_s``."""
    loop = asyncio.get_running_loop()
    deadline = None if wait_s is None else loop.time() + wait_s
    while True:
        block_ms = FOLLOW_POLL_MS if deadline is None else max(1, min(FOLLOW_POLL_MS, int((deadline - loop.time()) * 1000)))
        reply = await store.weights_redis.xread({key: f"0-{read}"}, count=count, block=block_ms)
        if reply:
            return reply[0][1]
        if deadline is not None and loop.time() >= deadline:
            return []
