"""A model version as a delta against the previous one: only the elements whose bits changed.

Exact: applied onto its base it gives the new version bit for bit, which the manifest proves. Why
and how chains are rebuilt: docs/design/model-versions.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from fulmen.errors import RecordError
from fulmen.versions.manifest import Manifest

if TYPE_CHECKING:
    import torch

IDX, VAL = "#idx", "#val"


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (NaN-safe, -0.0 ≠ 0.0: bits, not values)."""
    import torch

    flat = tensor.detach().reshape(-1)
    if not flat.is_floating_point():
        return flat
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(width)


def encode_delta(previous: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a delta that turns ``previous`` into ``current`` (same names; see the module)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, new in current.items():
        new = new.detach().to("cpu")
        old = previous.get(name)
        if old is None or old.dtype != new.dtype or old.shape != new.shape:
            out[name] = new
            continue
        changed = torch.nonzero(_bits(old.to("cpu")) != _bits(new)).reshape(-1)
        if changed.numel() == 0:
            continue
        sparse_bytes = changed.numel() * (4 + new.element_size())
        if new.numel() >= 2**31 or sparse_bytes >= new.numel() * new.element_size():
            out[name] = new
        else:
            out[name + IDX] = changed.to(torch.int32)
            out[name + VAL] = new.reshape(-1)[changed]
    return out


def apply_delta(delta: Mapping[str, torch.Tensor], manifest: Manifest, base: Callable[[str], torch.Tensor],
                version: str) -> dict[str, torch.Tensor]:
    """The tensors a delta changes, rebuilt from ``base(name)`` (the base version's tensor, in any
    dtype that holds its values exactly) and checked against the manifest; the caller's tensors are
    never modified. RecordError if a rebuilt tensor is not the trainer's (wrong base weights)."""
    changed: dict[str, torch.Tensor] = {}
    for key, tensor in delta.items():
        if key.endswith(VAL):
            continue
        if key.endswith(IDX):
            name = key.removesuffix(IDX)
            values = delta.get(name + VAL)
            entry = manifest.tensors.get(name)
            if values is None or entry is None:
                raise RecordError(f"model version {version}: delta for {name} lacks its values or manifest entry")
            rebuilt = base(name).detach().to("cpu").to(values.dtype, copy=True).reshape(-1)
            if rebuilt.numel() != _numel(entry.shape):
                raise RecordError(f"model version {version}: {name} of the base has {rebuilt.numel()} elements, "
                                  f"the manifest says {list(entry.shape)}")
            rebuilt.index_copy_(0, tensor.long(), values)
            changed[name] = rebuilt.reshape(entry.shape)
        else:
            changed[key] = tensor
    for name, tensor in changed.items():
        manifest.check(name, tensor, version)
    return changed


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
