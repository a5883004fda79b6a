"""Sharded checkpoints for FSDP ranks: each rank writes its own shard, nobody gathers the model.

Every rank calls `save` and `load` together; no pickle. The layout and the barriers: docs/design/trainer.md.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from fulmen_trainer import checkpoint as ckpt

SHARD = "shard-{rank}.safetensors"


def is_sharded(path: Path) -> bool:
    return (path / SHARD.format(rank=0)).exists()


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def save(directory: Path, checkpoint: ckpt.Checkpoint, model: Any, optimizer: torch.optim.Optimizer,
         rank: int, world: int, group: Any) -> Path:
    final = directory / f"step-{checkpoint.step}"
    tmp = directory / f".step-{checkpoint.step}.tmp"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier(group=group)
    tensors = {f"model.{n}": _local(p.detach()).contiguous().clone()
               for n, p in model.named_parameters() if p.requires_grad}
    optim = optimizer.state_dict()
    state = {i: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in optim["state"].items()}
    layout = {"state": ckpt._flatten("optim", state, tensors), "param_groups": optim["param_groups"]}
    save_file(tensors, str(tmp / SHARD.format(rank=rank)), metadata={"optimizer": json.dumps(layout)})
    dist.barrier(group=group)
    if rank == 0:
        meta = {"step": checkpoint.step, "model_version": checkpoint.model_version, "world": world,
                "consumed_entry_ids": checkpoint.consumed_entry_ids, "extra": checkpoint.extra}
        (tmp / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = directory / ".LATEST.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, directory / "LATEST")
        for old in sorted(directory.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[: -ckpt.KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return final


def load(path: Path, model: Any, optimizer: torch.optim.Optimizer, rank: int, world: int) -> ckpt.Checkpoint:
    """This rank's shard into the (already sharded) model and its optimizer; the checkpoint's meta."""
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("world") != world:
        raise RuntimeError(f"{path} was written by {meta.get('world')} FSDP ranks and this run has {world}: "
                           "resume with the same --nproc-per-node")
    shard = path / SHARD.format(rank=rank)
    tensors = load_file(str(shard))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                _local(p).copy_(tensors[f"model.{name}"])
    from safetensors import safe_open

    with safe_open(str(shard), framework="pt") as f:
        layout = json.loads(f.metadata()["optimizer"])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = ckpt._int_keys(ckpt._unflatten(layout["state"], tensors))
    for index, entry in state.items():
        p = params[index]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and hasattr(p, "device_mesh") and value.dim() > 0:
                from torch.distributed.tensor import DTensor

                entry[key] = DTensor.from_local(value.to(_local(p).device), p.device_mesh, p.placements,
                                                shape=p.shape, stride=p.stride())
    optimizer.load_state_dict({"state": state, "param_groups": layout["param_groups"]})
    return ckpt.Checkpoint(meta["step"], meta["model_version"], meta["consumed_entry_ids"], meta["extra"])
