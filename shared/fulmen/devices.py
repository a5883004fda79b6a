"""Where a model computes and in which precision: the ``device`` and ``dtype`` settings that the
trainer and the proxy's torch backend share. torch is imported inside the functions."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "resolve_device", "resolve_dtype"]

DTYPES = ("float32", "bfloat16")


def resolve_device(setting: str) -> torch.device:
    """``auto``: the first GPU when there is one, else the CPU; otherwise a torch device string."""
    import torch

    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(setting)
    except RuntimeError as e:
        raise ValueError(f"device {setting!r} is not a torch device ({e}); use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {setting!r}: this machine has no CUDA GPU; use --device cpu or auto")
    return device


def resolve_dtype(setting: str) -> torch.dtype:
    import torch

    if setting not in DTYPES:
        raise ValueError(f"dtype {setting!r} unknown; use {' or '.join(DTYPES)}")
    return getattr(torch, setting)
