"""What the vllm-sync tests share: a random LoRA adapter for the tiny model."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def random_adapter(base: Path, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """A PEFT-layout LoRA adapter on two of the model's projections, random by ``seed``."""
    weights = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    adapter = {}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        out_f, in_f = weights[name + ".weight"].shape
        adapter[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g)
        adapter[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g)
    return adapter
