"""Model versions through the store: the trainer publishes weights, the proxies fetch them.

Entry points `publish_model_version` (through a `fulmen.versions.transport.base.Transport`, chosen
by `transport_for`), `fetch_model_version`, `fetch_full_version`, `ModelVersion`. Weights are written
before the resources entry names them; versions are immutable. Transports, names and formats:
docs/design/model-versions.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from redis.exceptions import RedisError

from fulmen import keys as k
from fulmen.errors import InvalidInput, NotFound, RecordError
from fulmen.records import ResourcesUpdate
from fulmen.versions import blobs
from fulmen.versions.blobs import PublishedWeights, non_finite_tensors
from fulmen.versions.manifest import DELTA, FULL, LORA, Manifest
from fulmen.versions.transport.base import Payload, Transport
from fulmen.versions.transport.folder import FolderTransport
from fulmen.versions.transport.redis import RedisTransport

if TYPE_CHECKING:
    import torch

    from fulmen.store import RedisStore
    from fulmen.store.resources import UnreadableVersion

log = logging.getLogger(__name__)

__all__ = [
    "BASE_VERSION",
    "POLICY_RESOURCES_ID",
    "ModelVersion",
    "PublishOptions",
    "fetch_full_version",
    "fetch_model_version",
    "fetch_version",
    "is_published",
    "llm_resource",
    "next_model_version",
    "non_finite_tensors",
    "publish_model_version",
    "transport_for",
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


@dataclass(frozen=True)
class PublishOptions:
    """How a publish enters the resources log: the entry ``resources_id`` gets a new version with
    ``metadata``, starting from the previous one unless ``inherit`` is False, ``extra_resources`` over
    it. ``replace_unpublished`` (with a ``model_version``): weights stored under that name that no
    resources version names (a publish killed half-way) are deleted and written again, not refused."""

    resources_id: str = POLICY_RESOURCES_ID
    metadata: Mapping[str, Any] | None = None
    extra_resources: Mapping[str, Any] | None = None
    inherit: bool = True
    replace_unpublished: bool = False


DEFAULT_OPTIONS = PublishOptions()
DEFAULT_TRANSPORT = RedisTransport()


def transport_for(shared_dir: str | Path | None) -> Transport:
    """The transport a publish takes: files in the shared folder ``shared_dir``, or chunks on a Redis
    stream when there is none (the trainer's ``weights_dir``)."""
    return DEFAULT_TRANSPORT if shared_dir is None else FolderTransport(shared_dir)


async def publish_model_version(
    store: RedisStore,
    state_dict: Mapping[str, torch.Tensor],
    *,
    model: str,
    model_version: str | None = None,
    transport: Transport = DEFAULT_TRANSPORT,
    weights_format: Mapping[str, Any] | None = None,
    manifest: Manifest | None = None,
    options: PublishOptions = DEFAULT_OPTIONS,
) -> ResourcesUpdate:
    """Store the weights through ``transport`` (chunks on a Redis stream by default, `transport_for`),
    then publish a resources version naming them (see the module docstring and `PublishOptions`).

    ``weights_format``: how a backend applies these tensors, added to the ``weights`` entry (a LoRA
    adapter: ``{"format": "lora", "lora": {...}}``, see `fulmen.versions.lora`; a delta: ``{"format": "delta",
    "base_version": ...}`` with its ``manifest``); unset, they are full weights. The manifest of a full
    or LoRA version is computed here."""
    k.check_id("resources_id", options.resources_id)
    if model_version is not None:
        k.check_id("model_version", model_version)
        if options.replace_unpublished and not await is_published(store, model_version):
            await transport.delete(store, model_version)
    if options.extra_resources and "llm" in options.extra_resources:
        raise InvalidInput("extra_resources cannot set 'llm': publish_model_version writes it")
    transport.check(store)
    previous, unreadable = await _current(store, options.resources_id)
    payload = _payload(state_dict, weights_format, manifest)
    async with transport.writing(store, payload):
        version, weights = await _write(store, transport, payload, model_version, previous)
    if weights_format:
        weights = {**weights_format, **weights}
    llm = {"kind": "llm", "model": model, "model_version": version, "weights": weights}
    published = await _record(store, _next_resources(previous, options, llm), previous, options)
    await _set_aside(store, unreadable, published)
    from fulmen.versions.retention import record_stored

    # retention may delete it once it is old, but not while a kept delta needs it as its base
    assert payload.manifest is not None  # computed before it was written, or while it was
    await record_stored(store, version, published.version, base=payload.manifest.base_version,
                        manifest=payload.manifest.to_json())
    return published


async def next_model_version(
    store: RedisStore, resources_id: str = POLICY_RESOURCES_ID, shared_dir: str | Path | None = None
) -> ModelVersion:
    """The version a default publish to ``resources_id`` would take now: ``v<n+1>`` after its current
    version, past names whose weights exist already. A caller that must record the name before the
    weights exist (the trainer's checkpoint) reserves it this way and publishes it by name."""
    for name in _default_versions((await _current(store, resources_id))[0]):
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


async def _current(store: RedisStore, resources_id: str) -> tuple[ResourcesUpdate | None, list[UnreadableVersion]]:
    """The latest readable version of the resources entry ``resources_id`` (None before its first) and
    the newer ones no reader decodes, each with a warning: a publish goes on from the one before them
    and replaces them (`_set_aside`), where one unreadable entry would stop every publish."""
    previous, unreadable = await store.resources.get_readable_resources(resources_id)
    for bad in unreadable:
        log.warning("resources %s version %s cannot be read (%s): the next version published replaces it, "
                    "going on from %s", resources_id, bad.version, bad.reason,
                    "nothing" if previous is None else f"version {previous.version}")
    return previous, unreadable


async def _set_aside(store: RedisStore, unreadable: list[UnreadableVersion], published: ResourcesUpdate) -> None:
    """The unreadable versions ``published`` replaced, on the dead-letter stream with why, for a person
    to look at (they stay where they are, unread: the log and the hash keep every version)."""
    for bad in unreadable:
        reason = f"unreadable resources version, replaced by version {published.version}: {bad.reason}"
        try:
            await store.dead_letters.dead_letter(bad.key, bad.version, reason, {b"m": bad.record})
        except RedisError as e:  # the publish is done: a lost letter is not worth failing it
            log.warning("could not dead-letter resources version %s of %s: %r", bad.version, bad.key, e)


def _payload(state_dict: Mapping[str, torch.Tensor], weights_format: Mapping[str, Any] | None,
             manifest: Manifest | None) -> Payload:
    """What the publish writes; InvalidInput for a delta without its own manifest."""
    fmt = (weights_format or {}).get("format", FULL)
    if fmt == DELTA and (manifest is None or manifest.format != DELTA
                         or manifest.base_version != (weights_format or {}).get("base_version")):
        raise InvalidInput("a delta version needs its manifest (fulmen.versions.delta), naming the same base version")
    return Payload(state_dict, LORA if fmt == LORA else FULL, manifest)


async def _write(store: RedisStore, transport: Transport, payload: Payload, model_version: str | None,
                 previous: ResourcesUpdate | None) -> tuple[str, dict[str, Any]]:
    """The payload written as ``model_version``, or under the first free default name: the name and
    its weights entry. InvalidInput if ``model_version`` is taken."""
    names = [model_version] if model_version is not None else _default_versions(previous)
    for version in names:
        try:
            return version, await transport.write(store, version, payload)
        except blobs.VersionTaken:
            if model_version is not None:
                raise InvalidInput(f"model version {version} exists already; versions are immutable") from None
    raise InvalidInput("no free default model version name; pass model_version")  # pragma: no cover


def _next_resources(previous: ResourcesUpdate | None, options: PublishOptions, llm: dict[str, Any]) -> dict[str, Any]:
    """The resources of the new version: the previous ones (unless not inherited), the extra ones over
    them, and ``llm`` over the previous ``llm`` entry."""
    inherited = previous if options.inherit else None
    old = inherited.resources if inherited is not None else {}
    old_llm = (llm_resource(inherited) if inherited is not None else None) or {}
    # a new version ends a rollback (`fulmen.serving.rollback`) and an A/B test (`fulmen.serving.ab`)
    old_llm = {k: v for k, v in old_llm.items() if k not in ("rollback", "newest_version", "ab")}
    return {**old, **(options.extra_resources or {}), "llm": {**old_llm, **llm}}


async def _record(store: RedisStore, resources: dict[str, Any], previous: ResourcesUpdate | None,
                  options: PublishOptions) -> ResourcesUpdate:
    """``resources`` as the next version of ``options.resources_id`` (its first if there was none)."""
    if previous is None:
        with contextlib.suppress(InvalidInput):  # created meanwhile: fall through to a new version
            return await store.resources.add_resources(resources, options.resources_id, options.metadata)
    return await store.resources.update_resources(options.resources_id, resources, options.metadata)


def _default_versions(previous: ResourcesUpdate | None) -> Iterator[str]:
    # after a rollback the newest version ever published is further on than the served one
    newest = (llm_resource(previous) or {}).get("newest_version") if previous is not None else None
    n = max(ModelVersion.of(previous).number, ModelVersion.parse(newest if isinstance(newest, str) else None).number)
    return (ModelVersion.numbered(i).name for i in range(n + 1, n + MAX_NAME_TRIES + 1))


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
