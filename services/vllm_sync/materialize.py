"""A model version as a folder the vLLM server loads: a Hugging Face folder or a PEFT adapter folder.

Entry points `materialize` and `materialize_full`; the weights are copied once, checked against
the manifest. How and why: docs/design/vllm-sync.md.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fulmen.errors import NotFound, RecordError
from fulmen.store import RedisStore
from fulmen.versions import blobs
from fulmen.versions.folder import WEIGHTS_FILE, full_weights, write_model_folder
from fulmen.versions.lora import peft_adapter_config
from fulmen.versions.manifest import FULL, read_manifest
from fulmen.versions.transport.file_spares import retire, take_spare
from fulmen.versions.transport.stream import check_whole, read_stream

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def materialize(version: str, state: Mapping[str, torch.Tensor], weights: Mapping[str, Any], model_dir: Path,
                sync_dir: Path, keep: int = 2) -> Path:
    """Write ``version`` as a loadable folder under ``sync_dir``; returns it."""
    sync_dir.mkdir(parents=True, exist_ok=True)
    folder = write_model_folder(full_weights(state, weights, model_dir), model_dir, sync_dir / version)
    _drop_old(sync_dir, folder, keep)
    return folder


async def materialize_full(store: RedisStore, version: str, weights: Mapping[str, Any], model_dir: Path,
                           sync_dir: Path, keep: int = 2) -> Path | None:
    """Write a full version's blob as the weights file of a loadable folder under ``sync_dir`` (see the
    module docstring); None, with nothing written, when its manifest says it is not a full version (a
    delta or an adapter published without its format: the caller builds those from the tensors)."""
    sync_dir.mkdir(parents=True, exist_ok=True)
    folder, tmp = sync_dir / version, sync_dir / f".{version}.tmp"
    await asyncio.to_thread(_skeleton, model_dir, tmp)
    target = tmp / WEIGHTS_FILE
    try:
        if "path" in weights:
            await asyncio.to_thread(_copy_checked, Path(weights["path"]), target, version, weights.get("sha256"), sync_dir)
        else:
            await _stream_checked(store, version, target, weights.get("sha256"), sync_dir)
        with target.open("rb") as f:
            head = f.read(8)
            header = head + f.read(int.from_bytes(head[:8], "little") if len(head) == 8 else 0)
        manifest = read_manifest(header, version)
        if manifest is not None and manifest.format != FULL:
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _drop_old(sync_dir, folder, keep)
    return folder


def _skeleton(model_dir: Path, tmp: Path) -> None:
    """The base model's folder without its weights (config, tokenizer)."""
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.safetensors.index.json"))


async def _stream_checked(store: RedisStore, version: str, target: Path, sha256: str | None, sync_dir: Path) -> None:
    maps: list[mmap.mmap] = []

    def allocate(size: int) -> mmap.mmap:
        if size < 8:
            raise RecordError(f"model version {version} is not valid safetensors: {size} bytes")
        spare = take_spare(sync_dir, target, size)  # sized already
        fd = spare if spare is not None else os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if spare is None:
                os.ftruncate(fd, size)
            maps.append(mmap.mmap(fd, size))  # shared: the bytes land in the file itself
        finally:
            os.close(fd)
        return maps[-1]

    try:
        found = await read_stream(store, version, allocate)
        if found is None:
            raise NotFound(f"model version {version} has no weights in the store")
        blob, chunks_sha, checked = found
        if sha256 not in (None, chunks_sha):
            raise RecordError(f"model version {version}: its chunks' sha256 differs from the resource's")
        if checked is None:  # nothing proved on the way: the whole check, as any reader does
            await asyncio.to_thread(blobs.deserialize, version, blob, chunks_sha)
        del blob, found
    finally:
        for mapped in maps:
            mapped.close()


def _copy_checked(source: Path, target: Path, version: str, sha256: str | None, sync_dir: Path) -> None:
    """The shared folder's file copied (by the kernel: sendfile), then the copy checked — what vLLM
    will read is what was proved."""
    with source.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        fd = take_spare(sync_dir, target, size)
        if fd is None:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            copied = 0
            while copied < size:
                sent = os.sendfile(fd, f.fileno(), copied, size - copied)
                if sent == 0:
                    raise RecordError(f"model version {version}: {source} ended at {copied:,} of {size:,} bytes")
                copied += sent
        finally:
            os.close(fd)
    mapped = blobs.read_file(target)
    try:
        if check_whole(version, mapped, sha256) is None:
            blobs.deserialize(version, mapped, sha256)
    finally:
        if isinstance(mapped, mmap.mmap):
            mapped.close()


def materialize_adapter(version: str, adapter: Mapping[str, torch.Tensor], lora: Mapping[str, Any],
                        model_dir: Path, sync_dir: Path, keep: int = 3) -> Path:
    """Write a LoRA version as a PEFT adapter folder (the published tensors are in PEFT's layout
    already) that vLLM loads under its own name."""
    from safetensors.torch import save_file

    config = peft_adapter_config(adapter, lora, str(model_dir))
    sync_dir.mkdir(parents=True, exist_ok=True)
    folder, tmp = sync_dir / f"{version}-lora", sync_dir / f".{version}-lora.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({n: t.contiguous() for n, t in adapter.items()}, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    _drop_old(sync_dir, folder, keep)
    return folder


def _drop_old(sync_dir: Path, folder: Path, keep: int) -> None:
    """Keep the newest ``keep`` folders of the same kind as ``folder`` (adapters or whole models)."""
    lora = folder.name.endswith("-lora")
    folders = sorted((p for p in sync_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
                      and p.name.endswith("-lora") == lora),
                     key=lambda p: p.stat().st_mtime)
    for old in folders[:-keep]:
        if old != folder:
            retire(sync_dir, old.name)  # a whole model's weights file is kept for a later version
