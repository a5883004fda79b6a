"""A model version as a folder the vLLM server loads (``reload_weights`` reads a Hugging Face folder).

Full weights are written as they are; a LoRA adapter is merged onto the base model's weights first
(`fulmen.lora`: ``W = W_base + scaling · B @ A``), so the server needs no LoRA support. The folder
gets the base folder's config and tokenizer files beside ``model.safetensors``. Old folders are
deleted once newer ones exist (``keep``).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fulmen.lora import LORA_FORMAT, merge_lora

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json")


def base_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                tensors[name] = f.get_tensor(name)
    return tensors


def materialize(version: str, state: Mapping[str, torch.Tensor], weights: Mapping[str, Any], model_dir: Path,
                sync_dir: Path, keep: int = 2) -> Path:
    """Write ``version`` as a loadable folder under ``sync_dir``; returns it."""
    if weights.get("format") == LORA_FORMAT:
        base = base_weights(model_dir)
        full = {**base, **merge_lora(state, weights.get("lora") or {}, base.__getitem__)}
    else:
        full = dict(state)
    folder = sync_dir / version
    tmp = sync_dir / f".{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in CONFIG_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, tmp / name)
    save_file({n: t.contiguous() for n, t in full.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    folders = sorted((p for p in sync_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime)
    for old in folders[:-keep]:
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder
