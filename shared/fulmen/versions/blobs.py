"""A model version's bytes: one safetensors blob, written to a Redis stream of chunks or a file in a
shared folder, and checked on the way back. `fulmen.versions.model_version` decides names and resources.

Chunks stay out of the AOF where the server allows it; torch is imported inside the functions.
The one hash pass and why: docs/design/model-versions.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

from redis.exceptions import ResponseError

from fulmen.errors import InvalidInput, NotFound, RecordError
from fulmen.records import WeightsChunk
from fulmen.versions.manifest import HASH_THREADS, METADATA_KEY, Manifest, read_manifest
from fulmen.versions.transport.file_spares import WEIGHTS_FILE, take_spare

if TYPE_CHECKING:
    import torch

    from fulmen.store import RedisStore

CHUNK_HEADER_BYTES = 1024  # room for a chunk record's fields besides the data (version, sha256, ...)
PIPELINE_BYTES = 32 << 20  # chunk bytes sent and not yet answered (a pipeline on a cluster): bounded buffers
DATA_FIELD = "d"  # a chunk entry's bytes; its "m" record describes them (older writers put them inside it)
# XADD without propagating it to the AOF or replicas (see the module docstring); the id is explicit
# (a server without them, e.g. fakeredis, propagates nothing anyway)
XADD_OUTSIDE_AOF = """
if redis.replicate_commands then redis.replicate_commands() end
if redis.set_repl then redis.set_repl(redis.REPL_NONE) end
return redis.call('XADD', KEYS[1], ARGV[1], 'm', ARGV[2], 'd', ARGV[3])
"""
WEIGHTS_IN_AOF_ENV = "FULMEN_WEIGHTS_IN_AOF"  # the setting weights_in_aof: the chunks go through the AOF


def _codes() -> dict[torch.dtype, str]:
    import torch

    return {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL"}


def _raw(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as a buffer, without a copy (it is contiguous, on the CPU)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy()


class Blob:
    """A safetensors file as its parts, never joined into one buffer: the header (8-byte little-endian
    length, JSON padded to 8 bytes, the manifest in its metadata), then each tensor's bytes as a view
    of the tensor. Writing it copies each byte once, into the file or into a chunk."""

    def __init__(self, header: bytes, parts: list[memoryview]) -> None:
        self.header = header
        self.parts = [memoryview(header), *parts]
        self.size = sum(len(part) for part in self.parts)

    def __len__(self) -> int:
        return self.size

    def chunks(self, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        """Consecutive pieces of ``chunk_bytes`` (the last one shorter): a view of the tensor when the
        piece lies in one, joined bytes when it spans several."""
        pending: list[memoryview] = []
        filled = 0
        for part in self.parts:
            while len(part):
                take = part[: chunk_bytes - filled]
                pending.append(take)
                filled += len(take)
                part = part[len(take):]
                if filled == chunk_bytes:
                    yield pending[0] if len(pending) == 1 else b"".join(pending)
                    pending, filled = [], 0
        if pending or not self.size:
            yield pending[0] if len(pending) == 1 else b"".join(pending)

    def joined(self) -> bytearray:
        return bytearray(b"".join(self.parts))

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for part in self.parts:
            digest.update(part)
        return digest.hexdigest()


def serialize(state_dict: Mapping[str, torch.Tensor], manifest: Manifest) -> Blob:
    """The tensors as a safetensors file, written here rather than by `safetensors.torch.save` so no
    byte is copied before it is written: the widest dtypes first, so every tensor starts aligned to
    its element size."""
    import torch

    codes = _codes()
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInput(f"state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.dtype not in codes:
            raise InvalidInput(f"state_dict[{name!r}] is {tensor.dtype}: not a dtype a model version can hold")
        tensors.append((name, tensor))
    broken = non_finite_tensors(dict(tensors))
    if broken:
        raise InvalidInput(f"state_dict[{broken[0]!r}] holds NaN or infinite values: not publishing it")
    tensors.sort(key=lambda item: -item[1].element_size())
    header: dict[str, Any] = {"__metadata__": {"format": "pt", METADATA_KEY: manifest.to_json()}}
    offset = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": codes[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    parts = [memoryview(_raw(tensor)).cast("B") for _, tensor in tensors if tensor.numel()]
    return Blob(struct.pack("<Q", len(head)) + head, parts)


def blob_sha256(blob: Blob, manifest: Manifest) -> str:
    """The sha256 a blob is published with: its header's when the manifest covers its tensors, else
    the whole blob's (see the module docstring)."""
    return hashlib.sha256(blob.header).hexdigest() if manifest.covers_blob() else blob.sha256()


async def _outside_aof_script(redis: Any) -> str | None:
    """The sha1 of `XADD_OUTSIDE_AOF` loaded on ``redis``; None where chunks go through the AOF (a
    cluster, FULMEN_WEIGHTS_IN_AOF=1, a server that refuses scripts)."""
    from redis.asyncio.cluster import RedisCluster

    from fulmen.settings import env_setting

    if isinstance(redis, RedisCluster) or env_setting("weights_in_aof"):
        return None
    try:
        return str(await redis.script_load(XADD_OUTSIDE_AOF))
    except ResponseError:
        return None


def _xadd_args(script: str | None, key: str, index: int, fields: Mapping[str, Any]) -> list[Any]:
    if script is None:
        return ["XADD", key, f"0-{index + 1}", "m", fields["m"], DATA_FIELD, fields[DATA_FIELD]]
    return ["EVALSHA", script, 1, key, f"0-{index + 1}", fields["m"], fields[DATA_FIELD]]


async def write_stream(store: RedisStore, version: str, blob: Blob, sha256: str, chunk_bytes: int) -> dict:
    key = store.keys.weights(version)
    total = max(1, -(-len(blob) // chunk_bytes))
    pieces = blob.chunks(chunk_bytes)

    def entry(index: int) -> dict[str, Any]:
        # the bytes beside the record, not inside it: msgpack would copy each chunk twice on the way
        # out and once on the way in; a view goes to the socket as it is
        head = WeightsChunk(version, index, total, sha256, len(blob), b"").to_wire(store.max_record_bytes)
        return {"m": head, DATA_FIELD: next(pieces)}

    script = await _outside_aof_script(store.weights_redis)
    try:
        await store.weights_redis.execute_command(*_xadd_args(script, key, 0, entry(0)))
    except ResponseError:
        if await store.weights_redis.exists(key):
            raise VersionTaken from None
        raise
    try:
        per_pipeline = max(1, PIPELINE_BYTES // chunk_bytes)
        pool = getattr(store.weights_redis, "connection_pool", None)
        if pool is not None and hasattr(pool, "get_connection"):
            await _send_in_order(pool, range(1, total), lambda i: _xadd_args(script, key, i, entry(i)), per_pipeline)
        else:  # a cluster client: pipelines, one round trip at a time
            for first in range(1, total, per_pipeline):
                async with store.weights_redis.pipeline(transaction=False) as pipe:
                    for index in range(first, min(first + per_pipeline, total)):
                        pipe.xadd(key, entry(index), id=f"0-{index + 1}")
                    await pipe.execute()
    except BaseException:
        # A half-written version is never published; free its name for a later attempt.
        with contextlib.suppress(Exception):
            await store.weights_redis.delete(key)
        raise
    return {"stream": key, "chunks": total, "sha256": sha256, "bytes": len(blob)}


async def _send_in_order(pool: Any, indexes: range, command: Callable[[int], list[Any]], window: int) -> None:
    """XADD each chunk on one connection, up to ``window`` of them sent before their replies are read:
    the server is never idle waiting for the next batch, and no batch is joined into one buffer (a
    pipeline of redis-py waits for each batch's replies and copies its bytes once more). One
    connection keeps the entries in order, which their explicit ids require."""
    connection = await pool.get_connection()
    unread = 0
    try:
        for index in indexes:
            await connection.send_packed_command(connection.pack_command(*command(index)), check_health=False)
            unread += 1
            if unread > window:
                await connection.read_response()  # an error reply raises here
                unread -= 1
        while unread:
            await connection.read_response()
            unread -= 1
    finally:
        if unread:  # replies left unread: the connection's state is unknown
            await connection.disconnect()
        await pool.release(connection)


def write_file(shared_dir: Path, version: str, blob: Blob, sha256: str) -> dict:
    with claimed_file(shared_dir, version, len(blob)) as (path, f):
        for part in blob.parts:
            write_all(f, part)
    return {"path": str(path.resolve()), "sha256": sha256, "bytes": len(blob)}


@contextlib.contextmanager
def claimed_file(shared_dir: Path, version: str, size: int) -> Iterator[tuple[Path, BinaryIO]]:
    """``<shared_dir>/<version>/``, claimed (VersionTaken if it exists: one publisher per name), and the
    path its weights file will have with that file open for writing under a temporary name: renamed
    into place when the block ends (readers see the whole file or none), the folder removed if it fails.
    ``size``: the file's, when the block ends. The file is a deleted version's, to be written over,
    when there is one (`fulmen.versions.transport.file_spares`); then it is named ``.recycled`` while written,
    not ``.partial``: its size says nothing of what is written yet (`fulmen.versions.transport.file_follow`)."""
    folder = shared_dir / version
    try:
        folder.mkdir(parents=True, exist_ok=False)
    except FileExistsError:
        raise VersionTaken from None
    path = folder / WEIGHTS_FILE
    try:
        written = folder / (WEIGHTS_FILE + ".recycled")
        fd = take_spare(shared_dir, written, size)
        if fd is None:
            written = folder / (WEIGHTS_FILE + ".partial")
            fd = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb", buffering=0) as f:
            yield path, f
        written.replace(path)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def write_all(f: BinaryIO, data: bytes | bytearray | memoryview) -> None:
    """All of ``data`` into an unbuffered file (a raw write may take only part of it)."""
    view = memoryview(data)
    while len(view):
        view = view[f.write(view):]


def read_file(path: Path) -> bytearray | mmap.mmap:
    """The bytes of a regular file, memory-mapped (private: the tensors that view it may be written
    without touching the file). Opened without blocking and checked before reading: a path that names
    a FIFO would block the reading thread (and the follower awaiting it) until a writer came, a device
    such as /dev/zero would never end."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise NotFound(f"model weights file {path} does not exist") from None
    if fd is None:
        raise RecordError(f"model weights path {path} is not a regular file")
    with os.fdopen(fd, "rb"):
        info = os.fstat(fd)
        if info.st_size == 0:
            return bytearray()
        return mmap.mmap(fd, info.st_size, access=mmap.ACCESS_COPY)


def open_regular(path: Path) -> int | None:
    """A read-only descriptor of ``path`` if it is a regular file, else None (FileNotFoundError if it
    does not exist). Opened without blocking (see `read_file`)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


def deserialize(version: str, blob: Blob | bytes | bytearray | mmap.mmap, sha256: str | None,
                checked: str | None = None) -> PublishedWeights:
    """The tensors of a blob (checked against ``sha256``, see `blob_sha256`), as views of the blob:
    no copy. ``checked``: what a `fulmen.versions.transport.stream.BlobChecker` proved of these very bytes while
    they arrived (``"manifest"``: every tensor's sha256 and finiteness; ``"whole"``: the blob's
    sha256), not done again."""
    if isinstance(blob, Blob):
        blob = blob.joined()
    header = bytes(blob[: 8 + _header_size(version, blob)])
    manifest = read_manifest(header, version)
    if checked == "manifest":
        return PublishedWeights(_parse(version, blob), manifest)
    by_manifest = (manifest is not None and manifest.covers_blob()
                   and sha256 is not None and hashlib.sha256(header).hexdigest() == sha256)
    if not by_manifest and checked != "whole":  # a delta, a blob without a manifest (or from before `blob_sha256`), or corrupt
        actual = hashlib.sha256(blob).hexdigest()
        if sha256 is not None and actual != sha256:
            raise RecordError(
                f"model version {version} is corrupt: sha256 {actual[:12]}… expected {sha256[:12]}…"
            )
    state = _parse(version, blob)
    if by_manifest:
        assert manifest is not None
        manifest.check_all(state, version)
    broken = non_finite_tensors(state)
    if broken:
        raise RecordError(f"model version {version} holds NaN or infinite values in {broken[:5]}: refused")
    return PublishedWeights(state, manifest)


def _header_size(version: str, blob: bytes | bytearray | mmap.mmap, length: int | None = None) -> int:
    length = len(blob) if length is None else length
    if length < 8 or len(blob) < 8:
        raise RecordError(f"model version {version} is not valid safetensors: {length} bytes")
    (size,) = struct.unpack("<Q", blob[:8])
    if size > length - 8:
        raise RecordError(f"model version {version} is not valid safetensors: a header of {size:,} bytes")
    return int(size)


class TensorSpan(NamedTuple):
    """Where a tensor lies in a blob: ``start`` and ``end`` are offsets from the blob's first byte."""

    name: str
    dtype: torch.dtype
    shape: list[int]
    start: int
    end: int


def layout(version: str, blob: bytes | bytearray | mmap.mmap, length: int | None = None) -> list[TensorSpan]:
    """The tensors a blob's header declares, each checked to fit the blob and its dtype's alignment.
    Needs the header's bytes only (``blob`` has the whole blob's length, or ``length`` gives it; its
    data may still be on the way: `fulmen.versions.transport.stream`, `fulmen.versions.transport.file_follow`)."""
    import torch

    size = _header_size(version, blob, length)
    try:
        header = json.loads(bytes(blob[8 : 8 + size]))
    except ValueError as e:
        raise RecordError(f"model version {version} is not valid safetensors: {e}") from None
    if not isinstance(header, dict):
        raise RecordError(f"model version {version} is not valid safetensors: its header is not an object")
    dtypes = {code: dtype for dtype, code in _codes().items()}
    start, length = 8 + size, (len(blob) if length is None else length) - 8 - size
    spans: list[TensorSpan] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = dtypes[entry["dtype"]], [int(d) for d in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise RecordError(f"model version {version}: malformed entry for {name!r} ({e})") from None
        count = 1
        for d in shape:
            count *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= length or end - begin != count * itemsize or min(shape, default=0) < 0:
            raise RecordError(f"model version {version}: {name} has data_offsets [{begin}, {end}] that do not "
                              f"fit {entry['dtype']}{shape} in {length:,} bytes")
        if count and (start + begin) % itemsize:
            raise RecordError(f"model version {version}: {name} is not aligned to its {itemsize}-byte elements")
        spans.append(TensorSpan(name, dtype, shape, start + begin, start + end))
    return spans


def view(buffer: bytearray | mmap.mmap, span: TensorSpan) -> torch.Tensor:
    """The tensor ``span`` describes, as a view of ``buffer`` (writable: torch needs that)."""
    import torch

    if span.end == span.start:
        return torch.empty(span.shape, dtype=span.dtype)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=span.end - span.start, offset=span.start)
    return raw.view(span.dtype).reshape(span.shape)


def _parse(version: str, blob: bytes | bytearray | mmap.mmap) -> dict[str, torch.Tensor]:
    spans = layout(version, blob)
    # a bytes blob is read-only: torch views a writable copy-free buffer only
    buffer = blob if isinstance(blob, bytearray | mmap.mmap) else bytearray(blob)
    return {span.name: view(buffer, span) for span in spans}


def tensor_is_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in a floating-point tensor (integer tensors always are). The sum first: one
    pass, no temporary as large as the tensor, and NaN or infinity in any element makes it non-finite;
    only then (or when finite values overflow the sum) the exact element-wise check."""
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    # in the tensor's own dtype: torch accumulates in fp32 anyway, and bf16 sums asked for in fp32
    # take a slow path
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def non_finite_tensors(state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the tensors holding a NaN or an infinity (in the state dict's order): weights no
    backend may serve. Checked in parallel threads (torch releases the GIL): one tensor after the
    other, a loaded 2-core machine spent most of the pass handing each small tensor to torch's own
    threads."""
    names = list(state_dict)
    if len(names) < 2:
        return [name for name in names if not tensor_is_finite(state_dict[name])]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        finite = list(pool.map(lambda name: tensor_is_finite(state_dict[name]), names))
    return [name for name, ok in zip(names, finite, strict=True) if not ok]


class PublishedWeights(NamedTuple):
    """A version's tensors as stored, and its manifest (None for a blob published before manifests)."""

    state: dict[str, torch.Tensor]
    manifest: Manifest | None


class VersionTaken(Exception):
    """The version name is in use; the caller tries the next one or refuses."""
