"""Model versions through the store: the trainer publishes weights, the proxies fetch them.

Entry points `publish_model_version`, `fetch_model_version`, `fetch_full_version`, `ModelVersion`.
Weights are written before the resources entry names them; versions are immutable. Transports,
names and formats: docs/design/model-versions.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from fulmen import keys as k
from fulmen.errors import InvalidInput, NotFound, RecordError
from fulmen.records import ResourcesUpdate
from fulmen.store.redis.aof import writing_weights
from fulmen.versions import blobs
from fulmen.versions.blobs import CHUNK_HEADER_BYTES, PublishedWeights, non_finite_tensors
from fulmen.versions.manifest import DELTA, FULL, LORA, Manifest, describe_all
from fulmen.versions.transport.file_write import write_file_hashing

if TYPE_CHECKING:
    import torch

    from fulmen.store import RedisStore

log = logging.getLogger(__name__)

__all__ = [
    "BASE_VERSION",
    "POLICY_RESOURCES_ID",
    "ModelVersion",
    "fetch_full_version",
    "fetch_model_version",
    "fetch_version",
    "is_published",
    "llm_resource",
    "next_model_version",
    "non_finite_tensors",
    "publish_model_version",
    "wait_until_served",
]

POLICY_RESOURCES_ID = k.POLICY_RESOURCES_ID

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
    manifest: Manifest | None = None,
) -> ResourcesUpdate:
    """Store the weights, then publish a resources version naming them (see the module docstring).

    ``weights_format``: how a backend applies these tensors, added to the ``weights`` entry (a LoRA
    adapter: ``{"format": "lora", "lora": {...}}``, see `fulmen.versions.lora`; a delta: ``{"format": "delta",
    "base_version": ...}`` with its ``manifest``); unset, they are full weights. The manifest of a full
    or LoRA version is computed here.

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
        previous: ResourcesUpdate | None = await store.resources.get_resources(resources_id)
    except NotFound:
        previous = None
    fmt = (weights_format or {}).get("format", FULL)
    if fmt == DELTA and (manifest is None or manifest.format != DELTA
                         or manifest.base_version != (weights_format or {}).get("base_version")):
        raise InvalidInput("a delta version needs its manifest (fulmen.versions.delta), naming the same base version")
    # No AOF rewrite starts while the weights go to Redis, and one already running ends before the
    # first chunk (`fulmen.store.redis.aof`): meanwhile, the hashing and serialising below
    writing = writing_weights(store.weights_redis) if shared_dir is None else _no_rewrite_wait()
    # a full or LoRA version into the shared folder is hashed while it is written (the file's header,
    # which holds the hashes, is written last: `fulmen.versions.transport.file_write`)
    hash_while_writing = shared_dir is not None and manifest is None
    async with writing as rewrite_done:
        if not hash_while_writing:
            if manifest is None:
                manifest = Manifest(LORA if fmt == LORA else FULL, None, await asyncio.to_thread(describe_all, state_dict))
            blob = await asyncio.to_thread(blobs.serialize, state_dict, manifest)
            sha256 = await asyncio.to_thread(blobs.blob_sha256, blob, manifest)
        await rewrite_done()

        names = [model_version] if model_version is not None else _default_versions(previous)
        for version in names:
            try:
                if shared_dir is None:
                    weights = await blobs.write_stream(store, version, blob, sha256, chunk_bytes)
                elif hash_while_writing:
                    weights, manifest = await asyncio.to_thread(
                        write_file_hashing, Path(shared_dir), version, state_dict, LORA if fmt == LORA else FULL)
                else:
                    weights = await asyncio.to_thread(blobs.write_file, Path(shared_dir), version, blob, sha256)
                break
            except blobs.VersionTaken:
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
    # a new version ends a rollback (`fulmen.serving.rollback`) and an A/B test (`fulmen.serving.ab`)
    old_llm = {k: v for k, v in (old_llm or {}).items() if k not in ("rollback", "newest_version", "ab")}
    llm = {**old_llm, "kind": "llm", "model": model, "model_version": version, "weights": weights}
    resources = {**old, **(extra_resources or {}), "llm": llm}
    from fulmen.versions.retention import record_stored

    published: ResourcesUpdate | None = None
    if previous is None:
        with contextlib.suppress(InvalidInput):  # created meanwhile: fall through to a new version
            published = await store.resources.add_resources(resources, resources_id, metadata)
    if published is None:
        published = await store.resources.update_resources(resources_id, resources, metadata)
    # retention may delete it once it is old, but not while a kept delta needs it as its base
    assert manifest is not None  # computed above, or while the file was written
    await record_stored(store, version, published.version, base=manifest.base_version)
    return published


async def next_model_version(
    store: RedisStore, resources_id: str = POLICY_RESOURCES_ID, shared_dir: str | Path | None = None
) -> ModelVersion:
    """The version a default publish to ``resources_id`` would take now: ``v<n+1>`` after its current
    version, past names whose weights exist already. A caller that must record the name before the
    weights exist (the trainer's checkpoint) reserves it this way and publishes it by name."""
    try:
        previous: ResourcesUpdate | None = await store.resources.get_resources(resources_id)
    except NotFound:
        previous = None
    for name in _default_versions(previous):
        taken = await store.weights_redis.exists(store.keys.weights(name)) or (
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
    """The tensors of a published version as stored (a delta's are a delta), checked against its
    sha256 (see the module docstring).

    Raises NotFound if the version has no weights, RecordError if they are incomplete or corrupt.
    """
    return (await fetch_version(store, model_version, resource=resource)).state


async def fetch_full_version(
    store: RedisStore, model_version: str, *, resource: Mapping[str, Any] | None = None, max_chain: int = 1000
) -> PublishedWeights:
    """A version's whole weights: as stored for a full or LoRA version; a delta applied onto its base,
    rebuilt the same way (back to the nearest full version), each tensor checked against the manifest."""
    from fulmen.versions.delta import apply_delta

    found = await fetch_version(store, model_version, resource=resource)
    chain = [(model_version, found)]
    while (last := chain[-1][1]).manifest is not None and last.manifest.format == DELTA:
        if len(chain) > max_chain:
            raise RecordError(f"model version {model_version}: a chain of more than {max_chain} deltas")
        base = str(last.manifest.base_version)
        try:
            chain.append((base, await fetch_version(store, base)))
        except NotFound:
            raise NotFound(f"model version {chain[-1][0]} is a delta on {base}, whose weights are gone") from None
    name, full = chain.pop()
    state = full.state
    for name, delta in reversed(chain):
        assert delta.manifest is not None
        state = {**state, **await asyncio.to_thread(apply_delta, delta.state, delta.manifest, state.__getitem__, name)}
    if found.manifest is not None and found.manifest.format == DELTA:
        return PublishedWeights(state, Manifest(FULL, None, found.manifest.tensors))
    return PublishedWeights(state, found.manifest)


async def fetch_version(
    store: RedisStore, model_version: str, *, resource: Mapping[str, Any] | None = None,
    prefetched: tuple[Any, str, str | None] | None = None,
) -> PublishedWeights:
    """The tensors of a published version as stored and its manifest (see `fetch_model_version`).
    ``prefetched``: what `read_stream` (or `fulmen.versions.transport.file_follow`) read of this version while
    it was written (checked on the way, as any read is); used when the resource names that blob (its
    sha256), else read again."""
    from fulmen.versions.transport.stream import check_whole, read_stream

    k.check_id("model_version", model_version)
    weights = _weights_entry(resource) if resource is not None else None
    if prefetched is not None and names_blob(resource, prefetched[1]):
        return await asyncio.to_thread(blobs.deserialize, model_version, *prefetched)
    found = await read_stream(store, model_version) if weights is None else None
    if found is None and weights is None:
        weights = await _find_weights(store, model_version)
    if found is None and weights is not None:
        if "path" in weights:
            mapped = await asyncio.to_thread(blobs.read_file, Path(weights["path"]))
            checked = await asyncio.to_thread(check_whole, model_version, mapped, weights.get("sha256"))
            found = mapped, weights.get("sha256"), checked
        else:
            found = await read_stream(store, model_version)
            if found is not None and weights.get("sha256") not in (None, found[1]):
                raise RecordError(
                    f"model version {model_version}: its chunks' sha256 differs from the resource's"
                )
    if found is None:
        raise NotFound(f"model version {model_version} has no weights in the store")
    return await asyncio.to_thread(blobs.deserialize, model_version, *found)


async def wait_until_served(
    store: RedisStore, version: ModelVersion, timeout_s: float = SERVE_TIMEOUT_S, poll_s: float = SERVE_POLL_S
) -> bool:
    """Wait until at least one proxy is live and every live proxy serves ``version``; False after
    ``timeout_s`` (no proxy running, or one that cannot load it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        proxies = await store.registry.query_proxies()
        if proxies and all(p.model_version == version.name for p in proxies):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)


# --- writing ----------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _no_rewrite_wait() -> AsyncIterator[Callable[[], Awaitable[bool]]]:
    """A shared-folder publish writes no weights to Redis: no AOF rewrite to wait for or defer."""

    async def ready() -> bool:
        return True

    yield ready


def _default_versions(previous: ResourcesUpdate | None) -> Iterator[str]:
    # after a rollback the newest version ever published is further on than the served one
    newest = (llm_resource(previous) or {}).get("newest_version") if previous is not None else None
    n = max(ModelVersion.of(previous).number, ModelVersion.parse(newest if isinstance(newest, str) else None).number)
    return (ModelVersion.numbered(i).name for i in range(n + 1, n + MAX_NAME_TRIES + 1))


async def _delete_weights(store: RedisStore, version: str, shared_dir: str | Path | None) -> None:
    """Free a name whose weights were never published (a publisher killed half-way through)."""
    await store.weights_redis.delete(store.keys.weights(version))
    if shared_dir is not None:
        await asyncio.to_thread(shutil.rmtree, Path(shared_dir) / version, True)


# --- reading ----------------------------------------------------------------------------------------


def names_blob(resource: Mapping[str, Any] | None, sha256: str) -> bool:
    """Whether an ``llm`` (or weights) entry names weights (on a Redis stream or in a file) whose blob
    has ``sha256``."""
    if resource is None:
        return False
    weights = resource.get("weights", resource)
    return isinstance(weights, Mapping) and bool({"stream", "path"} & set(weights)) and weights.get("sha256") == sha256


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
    for update in await store.resources.query_resources(descending=True):
        llm = llm_resource(update)
        if (
            llm is not None
            and llm.get("model_version") == version
            and isinstance(llm.get("weights"), Mapping)
        ):
            return llm["weights"]
    return None


def wait_for_model_dir(folder: Path, log_every_s: float = 10.0) -> None:
    """Block until a Hugging Face folder exists (the demo writes its model after the warm start):
    services started together by honcho wait for it rather than fail, and say what they wait for."""
    last = 0.0
    while not (Path(folder) / "config.json").exists():
        if time.monotonic() - last >= log_every_s:
            log.warning("%s", model_dir_hint(folder))
            last = time.monotonic()
        time.sleep(0.5)


def model_dir_hint(folder: Path) -> str:
    """What a service waiting for its model folder says."""
    return (f"waiting for the model folder {folder} (no config.json there yet): the demo's warm start writes "
            "it; otherwise point --model-dir (FULMEN_MODEL_DIR) at a Hugging Face model folder on this machine")
