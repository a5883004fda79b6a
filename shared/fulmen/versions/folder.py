"""A model version as a Hugging Face folder: what vLLM's ``reload_weights`` reads and what a run
leaves as its final model.

LoRA versions are merged first; the folder is renamed into place. More: docs/design/model-versions.md.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulmen.errors import RecordError
from fulmen.versions.lora import LORA_FORMAT, merge_lora

if TYPE_CHECKING:
    import torch

    from fulmen.versions.model_version import PublishedWeights

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


def base_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                tensors[name] = f.get_tensor(name)
    return tensors


def full_weights(state: Mapping[str, torch.Tensor], weights: Mapping[str, Any], model_dir: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights of a version: ``state`` itself, or a LoRA adapter merged onto the base."""
    if weights.get("format") == LORA_FORMAT:
        base = base_weights(model_dir)
        return {**base, **merge_lora(state, weights.get("lora") or {}, base.__getitem__)}
    return dict(state)


def apply_onto_folder(found: PublishedWeights, folder: Path, version: str) -> dict[str, torch.Tensor] | None:
    """A delta version's whole weights, applied onto the folder of its base version (written by
    `write_model_folder`); None when that folder is gone or does not check out against the manifest."""
    from fulmen.versions.delta import apply_delta

    if found.manifest is None or not (folder / WEIGHTS_FILE).exists():
        return None
    full = base_weights(folder)
    try:
        full.update(apply_delta(found.state, found.manifest, full.__getitem__, version))
    except (RecordError, KeyError) as e:
        log.warning("model version %s does not apply onto %s (%s): rebuilding it from the store", version, folder, e)
        return None
    return full


def write_model_folder(full: Mapping[str, torch.Tensor], model_dir: Path, folder: Path,
                       extra: Mapping[str, str] | None = None) -> Path:
    """``folder`` = ``model_dir`` without its weights, plus ``full`` as ``model.safetensors`` and the
    ``extra`` text files (name → content). Replaces a folder of that name."""
    from safetensors.torch import save_file

    tmp = folder.parent / f".{folder.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.safetensors.index.json"))
    save_file({n: t.contiguous() for n, t in full.items()}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    for name, text in (extra or {}).items():
        (tmp / name).write_text(text)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
