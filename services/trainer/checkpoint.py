"""Checkpoints without pickle: safetensors for every tensor, JSON for everything else.

A folder ``step-<n>/`` renamed into place, then ``LATEST`` replaced atomically. The layout:
docs/design/trainer.md.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

KEEP = 2  # checkpoints kept on disk


@dataclass
class Checkpoint:
    step: int
    model_version: str
    consumed_entry_ids: list[str]  # acknowledged on the stream only after this checkpoint is written
    extra: dict[str, Any] = field(default_factory=dict)


def _flatten(prefix: str, value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Tensors go to ``tensors`` under a dotted name; the rest stays as JSON, with placeholders."""
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value.detach().contiguous().clone()
        return {"__tensor__": prefix}
    if isinstance(value, dict):
        return {str(k): _flatten(f"{prefix}.{k}", v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_flatten(f"{prefix}.{i}", v, tensors) for i, v in enumerate(value)]
    return value


def _unflatten(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        return {k: _unflatten(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    return value


def _int_keys(state: dict[str, Any]) -> dict[Any, Any]:
    """JSON turned the optimizer's integer parameter ids into strings; turn them back."""
    return {int(k) if k.isdigit() else k: v for k, v in state.items()}


def save(
    directory: Path,
    checkpoint: Checkpoint,
    model: Any,
    optimizer: torch.optim.Optimizer,
    codec_state: dict[str, Any] | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{checkpoint.step}"
    tmp = directory / f".step-{checkpoint.step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tensors: dict[str, torch.Tensor] = {}
    optim = optimizer.state_dict()
    meta = {
        "step": checkpoint.step,
        "model_version": checkpoint.model_version,
        "consumed_entry_ids": checkpoint.consumed_entry_ids,
        "extra": checkpoint.extra,
        "optimizer": {"state": _flatten("optim", optim["state"], tensors), "param_groups": optim["param_groups"]},
        "codec": _flatten("codec", codec_state or {}, tensors),
    }
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = directory / ".LATEST.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, directory / "LATEST")
    for old in sorted(directory.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(directory: Path) -> Path | None:
    marker = directory / "LATEST"
    if not marker.exists():
        return None
    path = directory / marker.read_text().strip()
    return path if (path / "meta.json").exists() else None


def load(path: Path, optimizer: torch.optim.Optimizer) -> tuple[Checkpoint, dict[str, Any]]:
    """Restore the optimizer in place; return the checkpoint and the codec state. (The model is loaded
    from ``path / "model"`` by the caller, like any Hugging Face folder.)"""
    meta = json.loads((path / "meta.json").read_text())
    tensors = load_file(str(path / "state.safetensors"))
    state = _int_keys(_unflatten(meta["optimizer"]["state"], tensors))
    optimizer.load_state_dict({"state": state, "param_groups": meta["optimizer"]["param_groups"]})
    checkpoint = Checkpoint(meta["step"], meta["model_version"], meta["consumed_entry_ids"], meta["extra"])
    return checkpoint, _unflatten(meta["codec"], tensors)
