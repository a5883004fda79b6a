"""A model version whose weights Redis lost, written again under its own name from the trainer's
checkpoint of it: the same bytes, checked tensor by tensor against the manifest the store kept.

Entry points `rebuild_version` (the trainer answering an ask, `fulmen rollback` with the trainer
stopped), `weights_lost`, `checkpoints_of`. The asks: `fulmen.versions.rebuild_asks`. Which versions
stay recoverable and why: docs/design/model-versions.md ("Lost weights, rebuilt").
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulmen.errors import FulmenError, InvalidInput, NotFound, RecordError
from fulmen.versions import blobs
from fulmen.versions.manifest import DELTA, LORA, Manifest
from fulmen.versions.retention import stored_versions
from fulmen.versions.transport.base import Payload
from fulmen.versions.transport.redis import RedisTransport

if TYPE_CHECKING:
    import torch

    from fulmen.store import RedisStore

log = logging.getLogger(__name__)

__all__ = ["RebuildRefused", "Rebuilt", "checkpoint_folder", "checkpoints_of", "rebuild_version", "weights_lost"]

# The layout `fulmen_trainer.checkpoints` writes: <checkpoint_dir>/rank-0/step-<n>/{meta.json, model/}
RANK0_FOLDER = "rank-0"
META_FILE = "meta.json"
MODEL_FOLDER = "model"
SHARD_FILE = "shard-0.safetensors"  # an FSDP checkpoint: a shard per rank, no whole model anywhere
MAX_CHAIN = 64  # deltas rebuilt back to their keyframe (the trainer's keyframe_every is far below)


class RebuildRefused(InvalidInput):
    """The version cannot be rebuilt with its own bytes; the message says why and what is left to do."""


@dataclass(frozen=True)
class Rebuilt:
    """``version`` is whole in the store again: rebuilt from ``checkpoint``, or it already was (None)."""

    version: str
    checkpoint: Path | None


def checkpoint_folder(checkpoint_dir: Path) -> Path:
    """Where the checkpoints that hold published weights are: rank 0's under the trainer's
    ``checkpoint_dir`` (a folder that already is one, with ``LATEST``, as it is)."""
    return checkpoint_dir if (checkpoint_dir / "LATEST").exists() else checkpoint_dir / RANK0_FOLDER


def checkpoints_of(folder: Path, version: str) -> list[Path]:
    """The checkpoints in ``folder`` whose meta names ``version``, oldest step first: the first is the
    step that published it (a later one with the same name holds the weights of later steps)."""
    found = []
    for path in folder.glob("step-*"):
        try:
            meta = json.loads((path / META_FILE).read_text())
        except (OSError, ValueError):
            continue  # half-deleted by the trainer's pruning, or not a checkpoint
        if meta.get("model_version") == version:
            found.append((int(meta.get("step", 0)), path))
    return [path for _, path in sorted(found)]


async def weights_lost(store: RedisStore, version: str) -> Mapping[str, Any] | None:
    """The weights entry of ``version`` if Redis holds fewer of its chunks than it was published
    with while retention still counts it as stored (it was lost, not deleted); else None."""
    from fulmen.versions.model_version import find_weights

    weights = await find_weights(store, version)
    if weights is None or "stream" not in weights or not isinstance(weights.get("chunks"), int):
        return None  # never published, or in a shared folder: not Redis's to lose
    if await store.weights_redis.xlen(store.keys.weights(version)) >= weights["chunks"]:
        return None
    return weights if version in await stored_versions(store) else None


async def rebuild_version(store: RedisStore, version: str, checkpoint_dir: Path, *, by: str = "fulmen",
                          _depth: int = 0) -> Rebuilt:
    """Write ``version``'s weights again from the trainer's checkpoint in ``checkpoint_dir`` if Redis
    lost them: the bytes that were published, proved by the stored manifest and the published sha256;
    then say so on the weights-rebuilds stream (as ``by``), for whoever waits for it. RebuildRefused
    says why not (no checkpoint of it, bytes that differ, a delta whose base is gone)."""
    from fulmen.versions.rebuild_asks import announce_rebuilt

    weights = await weights_lost(store, version)
    if weights is None:
        await _check_rebuildable(store, version)
        return Rebuilt(version, None)
    manifest = await _stored_manifest(store, version)
    folder = checkpoint_folder(checkpoint_dir)
    path, state = await asyncio.to_thread(_matching_checkpoint, folder, version, manifest, store.experiment)
    if manifest.format == DELTA:
        state = await _as_delta(store, version, state, manifest, checkpoint_dir, by, _depth)
    payload = Payload(state, LORA if manifest.format == LORA else manifest.format, manifest)
    transport = RedisTransport()
    async with transport.writing(store, payload):
        if payload.sha256 != weights.get("sha256"):
            raise RebuildRefused(f"model version {version}: every tensor of {path} matches its manifest, yet the "
                                 f"blob's sha256 is {payload.sha256}, not the published {weights.get('sha256')}")
        await transport.delete(store, version)  # the chunks Redis kept of it, if any
        try:
            written = await transport.write(store, version, payload)
        except blobs.VersionTaken:  # another rebuilder was quicker: its bytes are checked the same way
            return Rebuilt(version, None)
    if written.get("chunks") != weights["chunks"]:
        log.warning("model version %s rebuilt in %s chunks where it was published in %s", version,
                    written.get("chunks"), weights["chunks"])
    log.info("model version %s rebuilt from %s: its weights are stored again, the same bytes", version, path)
    await announce_rebuilt(store, version, by)
    return Rebuilt(version, path)


async def rebuild_here(store: RedisStore, version: str, checkpoint_dir: Path | None, *, by: str) -> bool:
    """Rebuild ``version`` from the trainer's checkpoints in ``checkpoint_dir`` when this host reads
    them (one host, a shared volume), so that no trainer needs to run (a finished run served again
    after a Redis restart). False, with a warning, when it cannot: the caller asks the others."""
    if checkpoint_dir is None or not checkpoint_dir.is_dir():
        return False
    try:
        rebuilt = await rebuild_version(store, version, checkpoint_dir, by=by)
    except FulmenError as e:
        log.warning("model version %s: not rebuilt from %s here (%s); asking the trainer", version, checkpoint_dir, e)
        return False
    if rebuilt.checkpoint is not None:
        log.info("model version %s rebuilt here (%s) from %s", version, by, rebuilt.checkpoint)
    return True


async def _check_rebuildable(store: RedisStore, version: str) -> None:
    """A version whose weights are not lost: fine if they are whole; else why nothing can bring them back."""
    from fulmen.versions.model_version import find_weights

    weights = await find_weights(store, version)
    if weights is None:
        raise RebuildRefused(f"model version {version} was never published: there is nothing to rebuild")
    if "stream" in weights and version not in await stored_versions(store):
        raise RebuildRefused(f"the weights of model version {version} were deleted by retention (only the newest "
                             "keep_versions and the served ones stay stored): it is not rebuilt")


async def _stored_manifest(store: RedisStore, version: str) -> Manifest:
    raw = await store.redis.hget(store.keys.version_manifests, version)
    if raw is None:
        raise RebuildRefused(f"model version {version}: the store kept no manifest of it (published by an older "
                             "Fulmen), so no rebuild could be proved to hold its bytes")
    return Manifest.from_json(raw.decode() if isinstance(raw, bytes) else raw, version)


def _matching_checkpoint(folder: Path, version: str, manifest: Manifest,
                         experiment: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """The first checkpoint of ``version`` whose weights are its manifest's tensors, bit for bit, as
    the version holds them (cast to each tensor's published dtype); RebuildRefused naming each
    candidate's difference when none is."""
    candidates = checkpoints_of(folder, version)
    if not candidates:
        raise RebuildRefused(f"model version {version}: no checkpoint of it in {folder} (the trainer keeps its "
                             "newest checkpoints and the one of its newest version; older ones are deleted)")
    why = []
    for path in candidates:
        try:
            state = _checkpoint_state(path, manifest, version, experiment)
            manifest.check_all(state, version)
            return path, state
        except (RecordError, RebuildRefused) as e:
            why.append(f"{path.name}: {e}")
    raise RebuildRefused(f"model version {version}: no checkpoint holds its bytes, so it is not rebuilt "
                         f"({'; '.join(why)})")


def _checkpoint_state(path: Path, manifest: Manifest, version: str, experiment: str) -> dict[str, torch.Tensor]:
    """The manifest's tensors read from the checkpoint at ``path``, in the manifest's order and dtypes."""
    import torch
    from safetensors.torch import load_file

    meta = json.loads((path / META_FILE).read_text())
    if meta.get("experiment") not in (None, experiment):
        raise RebuildRefused(f"a checkpoint of experiment {meta['experiment']!r}, not {experiment!r}")
    if (path / SHARD_FILE).exists():
        raise RebuildRefused("a sharded (FSDP) checkpoint: no file holds the whole model")
    found: dict[str, torch.Tensor] = {}
    for file in sorted((path / MODEL_FOLDER).glob("*.safetensors")):
        found.update(load_file(str(file)))
    missing = [name for name in manifest.tensors if name not in found]
    if missing:
        raise RebuildRefused(f"its model has no tensor {missing[0]!r} ({len(missing)} of the manifest's missing)")
    return {name: found[name].to(getattr(torch, entry.dtype)) for name, entry in manifest.tensors.items()}


async def _as_delta(store: RedisStore, version: str, state: dict[str, torch.Tensor], manifest: Manifest,
                    checkpoint_dir: Path, by: str, depth: int) -> dict[str, torch.Tensor]:
    """The delta ``version`` was published as: its whole weights (checked) against its base's, which
    are rebuilt first if Redis lost them too."""
    from fulmen.versions.delta import encode_delta
    from fulmen.versions.model_version import fetch_full_version

    base = str(manifest.base_version)
    if depth >= MAX_CHAIN:
        raise RebuildRefused(f"model version {version}: a chain of more than {MAX_CHAIN} deltas")
    await rebuild_version(store, base, checkpoint_dir, by=by, _depth=depth + 1)
    try:
        previous = (await fetch_full_version(store, base)).state
    except NotFound as e:
        raise RebuildRefused(f"model version {version} is a delta on {base}, whose weights are gone: {e}") from None
    return await asyncio.to_thread(encode_delta, previous, state)
