"""LoRA served beside the base weights in the torch engine: an adapter checked and made ready to
swap in (`prepare_lora`), and the forward hooks that add ``scaling · B(A x)`` to each adapted linear
layer's output (`set_lora`). Moved out of `fulmen_llm_proxy.backends.torch.engine`, which swaps them in."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulmen.errors import InvalidInput
from fulmen.versions.model_version import non_finite_tensors


@dataclass(frozen=True)
class LoraSwap:
    """A LoRA version to serve beside the base weights: per adapted layer (A, B), and the scaling."""

    layers: dict[str, tuple[Any, Any]]
    scaling: float


def prepare_lora(model: Any, model_dir: Path, adapter: Mapping[str, Any], lora: Mapping[str, Any]) -> LoraSwap:
    """An adapter checked against the model, in the model's dtype and device, ready to swap in."""
    from fulmen.versions.lora import adapter_targets

    scaling = float(lora.get("scaling", math.nan))
    if not math.isfinite(scaling):
        raise InvalidInput(f"LoRA version without a finite scaling: {dict(lora)!r}")
    broken = non_finite_tensors(adapter)
    if broken:
        raise InvalidInput(f"adapter holds NaN or infinite values in {broken[:5]}")
    own = model.state_dict()
    layers: dict[str, tuple[Any, Any]] = {}
    for name, (a_key, b_key) in adapter_targets(adapter).items():
        weight = own.get(name)
        if weight is None:
            raise InvalidInput(f"the adapter changes {name!r}, which the base model in {model_dir} lacks")
        a, b = adapter[a_key], adapter[b_key]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(weight.shape):
            raise InvalidInput(
                f"adapter for {name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the weight {tuple(weight.shape)}"
            )
        layers[name.removesuffix(".weight")] = (a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype))
    return LoraSwap(layers, scaling)


def set_lora(model: Any, hooks: dict[str, Any], layers: Mapping[str, tuple[Any, Any]], scaling: float) -> None:
    """Serve base + adapter: each adapted linear layer adds ``scaling · B(A x)`` to its output; a layer
    ``hooks`` (name -> hook handle, kept by the caller) has and ``layers`` does not goes back to base."""
    for name in set(hooks) - set(layers):
        model.get_submodule(name).fulmen_lora = None
    for name, (a, b) in layers.items():
        module = model.get_submodule(name)
        if name not in hooks:
            hooks[name] = module.register_forward_hook(lora_forward)
        module.fulmen_lora = (a, b, scaling)


def lora_forward(module: Any, inputs: tuple[Any, ...], output: Any) -> Any:
    """A linear layer's output plus its LoRA adapter's, when one is set (`set_lora`)."""
    import torch.nn.functional as F

    lora = getattr(module, "fulmen_lora", None)
    if lora is None:
        return output
    a, b, scaling = lora
    return output + scaling * F.linear(F.linear(inputs[0], a), b)
