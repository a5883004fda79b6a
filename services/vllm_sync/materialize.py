"""A model version as a folder the vLLM server loads: a Hugging Face folder for ``reload_weights``
(written by `fulmen.version_folder`), or a PEFT adapter folder for ``/v1/load_lora_adapter``; both
under ``sync_dir``, older folders deleted once newer ones exist (``keep``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fulmen.lora import adapter_targets
from fulmen.version_folder import full_weights, write_model_folder

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def materialize(version: str, state: Mapping[str, torch.Tensor], weights: Mapping[str, Any], model_dir: Path,
                sync_dir: Path, keep: int = 2) -> Path:
    """Write ``version`` as a loadable folder under ``sync_dir``; returns it."""
    sync_dir.mkdir(parents=True, exist_ok=True)
    folder = write_model_folder(full_weights(state, weights, model_dir), model_dir, sync_dir / version)
    _drop_old(sync_dir, folder, keep)
    return folder


def materialize_adapter(version: str, adapter: Mapping[str, torch.Tensor], lora: Mapping[str, Any],
                        model_dir: Path, sync_dir: Path, keep: int = 3) -> Path:
    """Write a LoRA version as a PEFT adapter folder (the published tensors are in PEFT's layout
    already) that vLLM loads under its own name. ``alpha`` is written so that PEFT's alpha/r is the
    version's scaling, whatever rule (rsLoRA) produced it."""
    from safetensors.torch import save_file

    targets = adapter_targets(adapter)
    ranks = {int(adapter[a_key].shape[0]) for a_key, _ in targets.values()}
    if len(ranks) != 1:
        raise ValueError(f"the adapter's layers have ranks {sorted(ranks)}: one rank is needed to load it as a LoRA adapter")
    rank = ranks.pop()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
              "r": rank, "lora_alpha": float(lora["scaling"]) * rank, "use_rslora": False, "bias": "none",
              "lora_dropout": 0.0, "fan_in_fan_out": False,
              "target_modules": sorted({name.removesuffix(".weight").rsplit(".", 1)[-1] for name in targets})}
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
            shutil.rmtree(old, ignore_errors=True)
