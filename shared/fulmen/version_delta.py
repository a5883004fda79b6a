"""A model version as a delta against the previous one: only the elements whose bits changed.

Full fine-tuning changes every weight a little, but a step's update is smaller than the weights'
rounding step for many of them — in bf16 (8 bits of mantissa) most elements keep their exact bits
from one version to the next. A delta stores, per tensor, the flat indices of the elements whose
bits changed (``<name>#idx``, int32) and their new values (``<name>#val``), or the whole tensor
(``<name>``) where that is smaller; tensors that did not change are left out. Comparing bits, not
values, makes the delta exact: applied onto the previous version it gives the new one bit for bit,
which the manifest's per-tensor sha256 then proves (`fulmen.version_manifest`).

A delta names its base version. A backend that serves the base applies it onto its own weights;
one that does not (a restart, a skipped version) rebuilds the version from the chain: the nearest
full version before it and every delta after that (`fulmen.model_versions.fetch_full_version`).
The trainer publishes a full version every ``keyframe_every`` versions, so a chain stays short, and
retention keeps a kept version's chain (`fulmen.version_retention`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from fulmen.errors import RecordError
from fulmen.version_manifest import Manifest

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
