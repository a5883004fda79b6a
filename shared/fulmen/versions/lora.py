"""LoRA model versions: what the trainer publishes with ``lora_rank`` set, and how a backend applies it.

The adapter alone, in PEFT's layout; ``W = W_base + scaling · B @ A``, always from the base. torch is
imported inside the functions. More: docs/design/model-versions.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fulmen.errors import InvalidInput

if TYPE_CHECKING:
    import torch

__all__ = ["LORA_FORMAT", "adapter_targets", "lora_description", "merge_lora"]

LORA_FORMAT = "lora"
PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


def lora_description(rank: int, alpha: float, rslora: bool = False) -> dict[str, Any]:
    """The ``lora`` entry of a version's weights: PEFT's scaling is alpha/r (alpha/√r with rsLoRA)."""
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    return {"r": rank, "alpha": alpha, "scaling": scaling}


def adapter_targets(adapter: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """The base weight each adapter pair changes: ``{"<module>.weight": (A key, B key)}``."""
    targets: dict[str, tuple[str, str]] = {}
    for key in adapter:
        if not key.endswith(_A):
            if not key.endswith(_B):
                raise InvalidInput(f"adapter tensor {key!r} is neither a lora_A nor a lora_B weight")
            continue
        module = key[: -len(_A)]
        b_key = module + _B
        if b_key not in adapter:
            raise InvalidInput(f"adapter has {key!r} but not {b_key!r}")
        name = module.removeprefix(PEFT_PREFIX) + ".weight"
        targets[name] = (key, b_key)
    if len(targets) * 2 != len(adapter):
        raise InvalidInput("adapter has lora_B weights without their lora_A")
    return targets


def peft_adapter_config(adapter: Mapping[str, Any], lora: Mapping[str, Any], base_model: str) -> dict[str, Any]:
    """The adapter_config.json PEFT (and vLLM) read for a LoRA version: one rank for every layer, and
    ``lora_alpha`` such that PEFT's alpha/r is the version's scaling, whatever rule (rsLoRA) made it."""
    targets = adapter_targets(adapter)
    ranks = sorted({int(adapter[a_key].shape[0]) for a_key, _ in targets.values()})
    if len(ranks) != 1:
        raise ValueError(f"the adapter's layers have ranks {ranks}: a PEFT adapter folder needs one rank")
    rank = ranks[0]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": rank, "lora_alpha": float(lora["scaling"]) * rank, "use_rslora": False, "bias": "none",
            "lora_dropout": 0.0, "fan_in_fan_out": False, "inference_mode": True,
            "target_modules": sorted({name.removesuffix(".weight").rsplit(".", 1)[-1] for name in targets})}


def merge_lora(
    adapter: Mapping[str, torch.Tensor], lora: Mapping[str, Any], base: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The merged weight of every adapted module: ``base(name) + scaling · B @ A`` in fp32, returned in
    the base weight's dtype. ``base`` gives a base weight by name (a backend's cache of its folder)."""
    scaling = float(lora.get("scaling", math.nan))
    if not math.isfinite(scaling):
        raise InvalidInput(f"LoRA version without a finite scaling: {dict(lora)!r}")
    merged = {}
    for name, (a_key, b_key) in adapter_targets(adapter).items():
        w = base(name)
        a, b = adapter[a_key].float(), adapter[b_key].float()
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise InvalidInput(
                f"adapter for {name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the weight {tuple(w.shape)}"
            )
        merged[name] = (w.float() + scaling * (b @ a)).to(w.dtype)
    return merged
