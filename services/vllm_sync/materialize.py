"""A model version as a folder the vLLM server loads (``reload_weights`` reads a Hugging Face folder):
written by `fulmen.version_folder` under ``sync_dir``; older folders are deleted once newer ones
exist (``keep``).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fulmen.version_folder import full_weights, write_model_folder


def materialize(version: str, state: Mapping[str, torch.Tensor], weights: Mapping[str, Any], model_dir: Path,
                sync_dir: Path, keep: int = 2) -> Path:
    """Write ``version`` as a loadable folder under ``sync_dir``; returns it."""
    sync_dir.mkdir(parents=True, exist_ok=True)
    folder = write_model_folder(full_weights(state, weights, model_dir), model_dir, sync_dir / version)
    folders = sorted((p for p in sync_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime)
    for old in folders[:-keep]:
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder
