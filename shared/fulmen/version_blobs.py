"""A model version's bytes: one safetensors blob (its manifest in the header), written to and read
from a Redis stream of chunks or a file in a shared folder, each checked on the way back (sha256,
chunk order, finite values). `fulmen.model_versions` decides names and resources; this moves bytes.

torch and safetensors are imported inside the functions: ``import fulmen`` never needs torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from redis.exceptions import ResponseError

from fulmen.errors import InvalidInput, NotFound, RecordError
from fulmen.records import WeightsChunk
from fulmen.version_manifest import METADATA_KEY, Manifest, read_manifest

if TYPE_CHECKING:
    import torch

    from fulmen.store import RedisStore

WEIGHTS_FILE = "model.safetensors"
CHUNK_HEADER_BYTES = 1024  # room for a chunk record's fields besides the data (version, sha256, ...)
PIPELINE_BYTES = 32 << 20  # chunks per round trip: few round trips, bounded client buffers
READ_PAGE_BYTES = 64 << 20  # chunks per XRANGE page, likewise


def serialize(state_dict: Mapping[str, torch.Tensor], manifest: Manifest) -> bytes:
    import torch
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInput(f"state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach().to("cpu").contiguous()
        if not tensor_is_finite(tensor):
            raise InvalidInput(f"state_dict[{name!r}] holds NaN or infinite values: not publishing it")
        # safetensors refuses tensors sharing memory (tied embeddings): each gets its own copy.
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages:
            tensor = tensor.clone()
        storages.add(storage)
        tensors[name] = tensor
    return save(tensors, metadata={"format": "pt", METADATA_KEY: manifest.to_json()})


async def write_stream(store: RedisStore, version: str, blob: bytes, sha256: str, chunk_bytes: int) -> dict:
    key = store.keys.weights(version)
    total = max(1, -(-len(blob) // chunk_bytes))

    def record(index: int) -> bytes:
        data = blob[index * chunk_bytes : (index + 1) * chunk_bytes]
        return WeightsChunk(version, index, total, sha256, len(blob), data).to_wire(store.max_record_bytes)

    try:
        await store.redis.xadd(key, {"m": record(0)}, id="0-1")
    except ResponseError:
        if await store.redis.exists(key):
            raise VersionTaken from None
        raise
    try:
        per_pipeline = max(1, PIPELINE_BYTES // chunk_bytes)
        for first in range(1, total, per_pipeline):
            async with store.redis.pipeline(transaction=False) as pipe:
                for index in range(first, min(first + per_pipeline, total)):
                    pipe.xadd(key, {"m": record(index)}, id=f"0-{index + 1}")
                await pipe.execute()
    except BaseException:
        # A half-written version is never published; free its name for a later attempt.
        with contextlib.suppress(Exception):
            await store.redis.delete(key)
        raise
    return {"stream": key, "chunks": total, "sha256": sha256, "bytes": len(blob)}


def write_file(shared_dir: Path, version: str, blob: bytes, sha256: str) -> dict:
    folder = shared_dir / version
    try:
        folder.mkdir(parents=True, exist_ok=False)  # the claim: one publisher per name
    except FileExistsError:
        raise VersionTaken from None
    try:
        path = folder / WEIGHTS_FILE
        partial = folder / (WEIGHTS_FILE + ".partial")
        with partial.open("wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        partial.replace(path)  # readers see the whole file or none
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return {"path": str(path.resolve()), "sha256": sha256, "bytes": len(blob)}


async def read_stream(store: RedisStore, version: str) -> tuple[bytes, str] | None:
    """The blob on the version's weights stream and its sha256 as the chunks state it; None if the
    stream has no chunk; RecordError if chunks are missing or out of place."""
    key = store.keys.weights(version)
    parts: list[bytes] = []
    first: WeightsChunk | None = None
    page = 1  # until the first chunk shows the chunk size
    while first is None or len(parts) < first.total:
        entries = await store.redis.xrange(key, min=f"0-{len(parts) + 1}", max="+", count=page)
        if not entries:
            break
        for _, fields in entries:
            chunk = WeightsChunk.from_wire(fields.get(b"m"), store.max_record_bytes)
            first = first or chunk
            found = (chunk.model_version, chunk.index, chunk.total, chunk.sha256, chunk.size)
            if found != (version, len(parts), first.total, first.sha256, first.size):
                raise RecordError(
                    f"model version {version}: expected chunk {len(parts)} of {first.total} on {key}, "
                    f"found chunk {chunk.index} of {chunk.total}: a chunk is missing or foreign"
                )
            parts.append(chunk.data)
        page = max(1, READ_PAGE_BYTES // max(1, len(first.data)))
    if first is None:
        return None
    if len(parts) != first.total:
        raise RecordError(
            f"model version {version} is incomplete: {len(parts)} of {first.total} chunks on {key}"
        )
    blob = b"".join(parts)
    if len(blob) != first.size:
        raise RecordError(f"model version {version} is {len(blob):,} bytes, expected {first.size:,}")
    return blob, first.sha256


def read_file(path: Path) -> bytes:
    """The bytes of a regular file. Opened without blocking and checked before reading: a path that
    names a FIFO would block the reading thread (and the follower awaiting it) until a writer came,
    a device such as /dev/zero would never end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NotFound(f"model weights file {path} does not exist") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RecordError(f"model weights path {path} is not a regular file")
        return f.read()


def deserialize(version: str, blob: bytes, sha256: str | None) -> PublishedWeights:
    from safetensors.torch import load

    actual = hashlib.sha256(blob).hexdigest()
    if sha256 is not None and actual != sha256:
        raise RecordError(
            f"model version {version} is corrupt: sha256 {actual[:12]}… expected {sha256[:12]}…"
        )
    try:
        state_dict = load(blob)
    except Exception as e:  # safetensors raises its own error type for a malformed header
        raise RecordError(f"model version {version} is not valid safetensors: {e}") from e
    broken = non_finite_tensors(state_dict)
    if broken:
        raise RecordError(f"model version {version} holds NaN or infinite values in {broken[:5]}: refused")
    return PublishedWeights(state_dict, read_manifest(blob, version))


def tensor_is_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in a floating-point tensor (integer tensors always are)."""
    import torch

    return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


def non_finite_tensors(state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the tensors holding a NaN or an infinity: weights no backend may serve."""
    return [name for name, tensor in state_dict.items() if not tensor_is_finite(tensor)]


class PublishedWeights(NamedTuple):
    """A version's tensors as stored, and its manifest (None for a blob published before manifests)."""

    state: dict[str, torch.Tensor]
    manifest: Manifest | None


class VersionTaken(Exception):
    """The version name is in use; the caller tries the next one or refuses."""
