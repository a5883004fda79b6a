"""Model versions through the store: the trainer publishes weights, the proxies fetch them.

A version's weights travel as one safetensors blob (`safetensors.torch.save`), in one of two ways:

- **stream** (default): the blob is cut into `WeightsChunk` records of at most ``chunk_bytes`` on the
  stream ``keys.weights(<version>)``, with entry ids ``0-1``, ``0-2``, … (chunk index + 1). Writing
  chunk 0 with the explicit id ``0-1`` claims the version atomically: Redis refuses it on a stream
  that already has entries, so two publishers can never mix their chunks under one name.
- **shared folder** (``shared_dir=``): the blob is written to ``<shared_dir>/<version>/model.safetensors``
  (a temporary file renamed into place), for a folder every proxy mounts at the same path.

Then, and only then, the resources entry ``resources_id`` gets a new version whose ``"llm"`` entry
names the model version, so whoever sees the version can always fetch it::

    {"llm": {"kind": "llm", "model": <model>, "model_version": "v3",
             "weights": {"stream": <key>, "chunks": 2, "sha256": <hex>, "bytes": 5_000_000}}}
             # or "weights": {"path": "/shared/v3/model.safetensors", "sha256": <hex>, "bytes": ...}

The new resources version starts from the previous one (other resources and other ``llm`` keys, such
as proxy URLs, carry over; ``inherit=False`` starts empty); ``extra_resources`` overrides them.

A version is one value, `ModelVersion` (number, name): the number orders versions (staleness, the
``fulmen_model_version`` gauge), the name keys its weights and travels in resources and spans.
`ModelVersion.parse` is the one place a name turns back into a number.

Version names: an explicit ``model_version`` that exists already is refused (versions are immutable).
By default the name is ``v<n+1>`` after the previous version ``v<n>`` of ``resources_id`` (``v1``
first); a name already taken (by another resources id, or by a publish that crashed before the
resources entry) is skipped for the next number. One publisher per resources id is expected.

`fetch_model_version` reads whichever transport the version used: with ``resource`` (the ``llm``
entry, or its ``weights``) it goes straight there; without, it reads the weights stream and, if the
version has none, looks the version up in the resources log (a shared-folder version).

torch and safetensors are imported inside the functions: ``import fulmen`` never needs torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from redis.exceptions import ResponseError

from fulmen import keys as k
from fulmen.errors import InvalidInput, NotFound, RecordError
from fulmen.records import ResourcesUpdate, WeightsChunk

if TYPE_CHECKING:
    import torch

    from fulmen.store import RedisStore

log = logging.getLogger(__name__)

__all__ = [
    "BASE_VERSION",
    "POLICY_RESOURCES_ID",
    "ModelVersion",
    "fetch_model_version",
    "is_published",
    "llm_resource",
    "next_model_version",
    "non_finite_tensors",
    "publish_model_version",
    "wait_until_served",
]

POLICY_RESOURCES_ID = "policy"  # the resources entry the trainer publishes to and rollouts are run with

WEIGHTS_FILE = "model.safetensors"
CHUNK_HEADER_BYTES = 1024  # room for a chunk record's fields besides the data (version, sha256, ...)
PIPELINE_BYTES = 32 << 20  # chunks per round trip: few round trips, bounded client buffers
READ_PAGE_BYTES = 64 << 20  # chunks per XRANGE page, likewise
SERVE_TIMEOUT_S = 60.0  # a proxy loads a version in seconds; a minute means none is coming
SERVE_POLL_S = 0.1
MAX_NAME_TRIES = 1000  # default names skipped as taken before giving up (each was a crashed publish)


class ModelVersion(NamedTuple):
    """A model version: ``number`` (0 for the base weights, n for the n-th published version) and
    ``name`` (``"base"``, ``"v<n>"``, or a name given to `publish_model_version`)."""

    number: int
    name: str

    @classmethod
    def numbered(cls, number: int) -> ModelVersion:
        """The default name of the ``number``-th version: ``v<number>`` (0 is the base weights)."""
        return cls(number, f"v{number}") if number > 0 else BASE_VERSION

    @classmethod
    def parse(cls, name: str | None) -> ModelVersion:
        """The version a stored name stands for: ``"v12"`` → 12; the base weights, no name, or a name
        given by hand (``"trained-1"``) → 0, as it says nothing about its place in the order."""
        if name and name[0] == "v" and name[1:].isdigit():
            return cls(int(name[1:]), name)
        return cls(0, name or BASE_VERSION.name)

    @classmethod
    def of(cls, update: ResourcesUpdate | None) -> ModelVersion:
        """The model version a resources update names (base when it names none)."""
        llm = llm_resource(update) if update is not None else None
        return cls.parse((llm or {}).get("model_version"))

    def __str__(self) -> str:
        return self.name


BASE_VERSION = ModelVersion(0, "base")


class _VersionTaken(Exception):
    """Internal: the version name is in use; the caller tries the next one or refuses."""


def llm_resource(update: ResourcesUpdate) -> dict[str, Any] | None:
    """The ``"llm"`` entry of a resources update, or None if it has none."""
    value = update.resources.get("llm")
    return value if isinstance(value, dict) else None


async def publish_model_version(
    store: RedisStore,
    state_dict: Mapping[str, torch.Tensor],
    *,
    model: str,
    model_version: str | None = None,
    resources_id: str = POLICY_RESOURCES_ID,
    chunk_bytes: int = 4 << 20,
    metadata: Mapping[str, Any] | None = None,
    extra_resources: Mapping[str, Any] | None = None,
    shared_dir: str | Path | None = None,
    inherit: bool = True,
    replace_unpublished: bool = False,
    weights_format: Mapping[str, Any] | None = None,
) -> ResourcesUpdate:
    """Store the weights, then publish a resources version naming them (see the module docstring).

    ``weights_format``: how a backend applies these tensors, added to the ``weights`` entry (a LoRA
    adapter: ``{"format": "lora", "lora": {...}}``, see `fulmen.lora`); unset, they are full weights.

    ``replace_unpublished`` (with ``model_version``): weights stored under that name that no resources
    version names (a publish killed half-way) are deleted and written again, instead of refused."""
    k.check_id("resources_id", resources_id)
    if model_version is not None:
        k.check_id("model_version", model_version)
        if replace_unpublished and not await is_published(store, model_version):
            await _delete_weights(store, model_version, shared_dir)
    if extra_resources and "llm" in extra_resources:
        raise InvalidInput("extra_resources cannot set 'llm': publish_model_version writes it")
    limit = store.max_record_bytes - CHUNK_HEADER_BYTES
    if shared_dir is None and not 0 < chunk_bytes <= limit:
        raise InvalidInput(
            f"chunk_bytes is {chunk_bytes:,}; it must be between 1 and {limit:,} (the store's "
            f"max_record_bytes {store.max_record_bytes:,} minus {CHUNK_HEADER_BYTES} for the record header)"
        )
    try:
        previous: ResourcesUpdate | None = await store.get_resources(resources_id)
    except NotFound:
        previous = None
    blob = await asyncio.to_thread(_serialize, state_dict)
    sha256 = hashlib.sha256(blob).hexdigest()

    names = [model_version] if model_version is not None else _default_versions(previous)
    for version in names:
        try:
            if shared_dir is None:
                weights = await _write_stream(store, version, blob, sha256, chunk_bytes)
            else:
                weights = await asyncio.to_thread(_write_file, Path(shared_dir), version, blob, sha256)
            break
        except _VersionTaken:
            if model_version is not None:
                raise InvalidInput(
                    f"model version {version} exists already; versions are immutable"
                ) from None
    else:  # pragma: no cover - MAX_NAME_TRIES taken names in a row
        raise InvalidInput("no free default model version name; pass model_version")
    if weights_format:
        weights = {**weights_format, **weights}

    old = previous.resources if previous is not None and inherit else {}
    old_llm = llm_resource(previous) if previous is not None and inherit else None
    llm = {**(old_llm or {}), "kind": "llm", "model": model, "model_version": version, "weights": weights}
    resources = {**old, **(extra_resources or {}), "llm": llm}
    from fulmen.version_retention import record_stored

    published: ResourcesUpdate | None = None
    if previous is None:
        with contextlib.suppress(InvalidInput):  # created meanwhile: fall through to a new version
            published = await store.add_resources(resources, resources_id, metadata)
    if published is None:
        published = await store.update_resources(resources_id, resources, metadata)
    await record_stored(store, version, published.version)  # retention may delete it once it is old
    return published


async def next_model_version(
    store: RedisStore, resources_id: str = POLICY_RESOURCES_ID, shared_dir: str | Path | None = None
) -> ModelVersion:
    """The version a default publish to ``resources_id`` would take now: ``v<n+1>`` after its current
    version, past names whose weights exist already. A caller that must record the name before the
    weights exist (the trainer's checkpoint) reserves it this way and publishes it by name."""
    try:
        previous: ResourcesUpdate | None = await store.get_resources(resources_id)
    except NotFound:
        previous = None
    for name in _default_versions(previous):
        taken = await store.redis.exists(store.keys.weights(name)) or (
            shared_dir is not None and (Path(shared_dir) / name).exists()
        )
        if not taken:
            return ModelVersion.parse(name)
    raise InvalidInput("no free default model version name; pass model_version")  # pragma: no cover


async def is_published(store: RedisStore, model_version: str) -> bool:
    """Whether a resources version names ``model_version`` (its weights are then complete)."""
    return await _find_weights(store, model_version) is not None


async def fetch_model_version(
    store: RedisStore, model_version: str, *, resource: Mapping[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The state dict of a published version, checked against its sha256 (see the module docstring).

    Raises NotFound if the version has no weights, RecordError if they are incomplete or corrupt.
    """
    k.check_id("model_version", model_version)
    weights = _weights_entry(resource) if resource is not None else None
    found = await _read_stream(store, model_version) if weights is None else None
    if found is None and weights is None:
        weights = await _find_weights(store, model_version)
    if found is None and weights is not None:
        if "path" in weights:
            blob = await asyncio.to_thread(_read_file, Path(weights["path"]))
            found = blob, weights.get("sha256")
        else:
            found = await _read_stream(store, model_version)
            if found is not None and weights.get("sha256") not in (None, found[1]):
                raise RecordError(
                    f"model version {model_version}: its chunks' sha256 differs from the resource's"
                )
    if found is None:
        raise NotFound(f"model version {model_version} has no weights in the store")
    return await asyncio.to_thread(_deserialize, model_version, *found)


async def wait_until_served(
    store: RedisStore, version: ModelVersion, timeout_s: float = SERVE_TIMEOUT_S, poll_s: float = SERVE_POLL_S
) -> bool:
    """Wait until at least one proxy is live and every live proxy serves ``version``; False after
    ``timeout_s`` (no proxy running, or one that cannot load it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        proxies = await store.query_proxies()
        if proxies and all(p.model_version == version.name for p in proxies):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)


# --- writing ----------------------------------------------------------------------------------------


def _default_versions(previous: ResourcesUpdate | None) -> Iterator[str]:
    n = ModelVersion.of(previous).number
    return (ModelVersion.numbered(i).name for i in range(n + 1, n + MAX_NAME_TRIES + 1))


def _serialize(state_dict: Mapping[str, torch.Tensor]) -> bytes:
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
    return save(tensors, metadata={"format": "pt"})


async def _write_stream(store: RedisStore, version: str, blob: bytes, sha256: str, chunk_bytes: int) -> dict:
    key = store.keys.weights(version)
    total = max(1, -(-len(blob) // chunk_bytes))

    def record(index: int) -> bytes:
        data = blob[index * chunk_bytes : (index + 1) * chunk_bytes]
        return WeightsChunk(version, index, total, sha256, len(blob), data).to_wire(store.max_record_bytes)

    try:
        await store.redis.xadd(key, {"m": record(0)}, id="0-1")
    except ResponseError:
        if await store.redis.exists(key):
            raise _VersionTaken from None
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


async def _delete_weights(store: RedisStore, version: str, shared_dir: str | Path | None) -> None:
    """Free a name whose weights were never published (a publisher killed half-way through)."""
    await store.redis.delete(store.keys.weights(version))
    if shared_dir is not None:
        await asyncio.to_thread(shutil.rmtree, Path(shared_dir) / version, True)


def _write_file(shared_dir: Path, version: str, blob: bytes, sha256: str) -> dict:
    folder = shared_dir / version
    try:
        folder.mkdir(parents=True, exist_ok=False)  # the claim: one publisher per name
    except FileExistsError:
        raise _VersionTaken from None
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


# --- reading ----------------------------------------------------------------------------------------


def _weights_entry(resource: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``weights`` mapping of an ``llm`` entry (or ``resource`` itself if it is one)."""
    weights = resource.get("weights", resource)
    if not isinstance(weights, Mapping) or not ({"path", "stream"} & set(weights)):
        raise InvalidInput("resource is neither an llm entry with 'weights' nor a weights entry")
    return weights


async def find_weights(store: RedisStore, version: str) -> Mapping[str, Any] | None:
    """The weights entry (``llm["weights"]``) that publishes ``version``; None if none does."""
    return await _find_weights(store, version)


async def _find_weights(store: RedisStore, version: str) -> Mapping[str, Any] | None:
    """The weights entry of the latest resources version that publishes ``version``."""
    for update in await store.query_resources(descending=True):
        llm = llm_resource(update)
        if (
            llm is not None
            and llm.get("model_version") == version
            and isinstance(llm.get("weights"), Mapping)
        ):
            return llm["weights"]
    return None


async def _read_stream(store: RedisStore, version: str) -> tuple[bytes, str] | None:
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


def _read_file(path: Path) -> bytes:
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


def _deserialize(version: str, blob: bytes, sha256: str | None) -> dict[str, torch.Tensor]:
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
    return state_dict


def tensor_is_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in a floating-point tensor (integer tensors always are)."""
    import torch

    return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


def non_finite_tensors(state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the tensors holding a NaN or an infinity: weights no backend may serve."""
    return [name for name, tensor in state_dict.items() if not tensor_is_finite(tensor)]


def wait_for_model_dir(folder: Path, log_every_s: float = 10.0) -> None:
    """Block until a Hugging Face folder exists (the demo writes its model after the warm start):
    services started together by honcho wait for it rather than fail, and say what they wait for."""
    last = 0.0
    while not (Path(folder) / "config.json").exists():
        if time.monotonic() - last >= log_every_s:
            log.info("waiting for the model folder %s to appear", folder)
            last = time.monotonic()
        time.sleep(0.5)
