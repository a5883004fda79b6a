"""What a model version holds, tensor by tensor: the manifest that travels inside its weights.

JSON under ``fulmen.manifest`` in the safetensors metadata: format, base version, and per tensor
dtype, shape and sha256. What it guards: docs/design/model-versions.md.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fulmen.errors import RecordError

if TYPE_CHECKING:
    import torch

METADATA_KEY = "fulmen.manifest"
FULL, LORA, DELTA = "full", "lora", "delta"
FORMATS = (FULL, LORA, DELTA)
HASH_THREADS = 4  # hashlib releases the GIL: large tensors hash in parallel


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    sha256: str


@dataclass(frozen=True)
class Manifest:
    format: str
    base_version: str | None = None
    tensors: dict[str, TensorEntry] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({
            "format": self.format, "base_version": self.base_version,
            "tensors": {n: [e.dtype, list(e.shape), e.sha256] for n, e in self.tensors.items()},
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, version: str) -> Manifest:
        try:
            raw = json.loads(text)
            tensors = {str(n): TensorEntry(str(d), tuple(int(x) for x in s), str(h)) for n, (d, s, h) in raw["tensors"].items()}
            manifest = cls(str(raw["format"]), raw.get("base_version"), tensors)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise RecordError(f"model version {version} has a malformed manifest: {e}") from None
        if manifest.format not in FORMATS:
            raise RecordError(f"model version {version} has format {manifest.format!r}; known: {', '.join(FORMATS)}")
        if manifest.format == DELTA and not manifest.base_version:
            raise RecordError(f"model version {version} is a delta without a base version")
        return manifest

    def check(self, name: str, tensor: torch.Tensor, version: str) -> None:
        """Raise RecordError unless ``tensor`` is exactly what the manifest says ``name`` is."""
        entry = self.tensors.get(name)
        if entry is None:
            raise RecordError(f"model version {version}: its manifest has no tensor {name!r}")
        got = describe(tensor)
        if (got.dtype, got.shape) != (entry.dtype, entry.shape):
            raise RecordError(f"model version {version}: {name} is {got.dtype}{list(got.shape)}, "
                              f"the manifest says {entry.dtype}{list(entry.shape)}")
        if got.sha256 != entry.sha256:
            raise RecordError(f"model version {version}: {name} does not match its manifest's sha256 "
                              f"(applied onto the wrong weights?)")


    def check_all(self, state: Mapping[str, torch.Tensor], version: str) -> None:
        """Raise RecordError unless ``state`` holds exactly the manifest's tensors, each with its bytes."""
        if set(state) != set(self.tensors):
            extra, missing = sorted(set(state) - set(self.tensors)), sorted(set(self.tensors) - set(state))
            raise RecordError(f"model version {version}: its tensors are not its manifest's "
                              f"(not in the manifest: {extra[:3]}, missing: {missing[:3]})")
        for name, got in describe_all(state).items():
            entry = self.tensors[name]
            if got != entry:
                what = "sha256" if (got.dtype, got.shape) == (entry.dtype, entry.shape) else "dtype or shape"
                raise RecordError(f"model version {version} is corrupt: {name} does not match its manifest's {what}")

    def covers_blob(self) -> bool:
        """Whether the manifest describes the blob's own tensors (not a delta's rebuilt ones)."""
        return self.format in (FULL, LORA)


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def tensor_sha256(tensor: torch.Tensor) -> str:
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
    return hashlib.sha256(raw.numpy().data).hexdigest()


def describe(tensor: torch.Tensor) -> TensorEntry:
    return TensorEntry(dtype_name(tensor), tuple(tensor.shape), tensor_sha256(tensor))


def describe_all(state: Mapping[str, torch.Tensor]) -> dict[str, TensorEntry]:
    # the largest first, so the pool's threads finish together
    names = sorted(state, key=lambda n: -state[n].numel() * state[n].element_size())
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        found = dict(zip(names, pool.map(lambda n: describe(state[n]), names), strict=True))
    return {name: found[name] for name in state}


def read_manifest(blob: bytes, version: str) -> Manifest | None:
    """The manifest in a safetensors blob's header, None for a blob published without one."""
    if len(blob) < 8:
        raise RecordError(f"model version {version} is not valid safetensors: {len(blob)} bytes")
    (size,) = struct.unpack("<Q", blob[:8])
    try:
        header: dict[str, Any] = json.loads(blob[8 : 8 + size])
    except ValueError as e:
        raise RecordError(f"model version {version} is not valid safetensors: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__") or {}, dict):
        raise RecordError(f"model version {version} is not valid safetensors: its header is not an object")
    text = (header.get("__metadata__") or {}).get(METADATA_KEY)
    return Manifest.from_json(text, version) if text is not None else None
