"""Sparse gradients on the wire, error-feedback state, and the exact ``topk`` codec.

The layout (block counts, uint16 indices, scaled fp16 values) is shared with ``dgc``; the residual
keeps ``sum(decoded) + residual == sum(gradients)``. The layout and why: docs/design/trainer.md.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from fulmen.errors import InvalidInput, RecordError
from fulmen_trainer.distributed.codecs.base import CodecState, check_end, check_section, register_codec
from fulmen_trainer.distributed.codecs.framing import Payload

log = logging.getLogger(__name__)

BLOCK_SHIFT = 16
BLOCK = 1 << BLOCK_SHIFT  # elements per index block: block-local indices fit in uint16
_VALUE_DTYPES = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4")}


def pack_sparse(
    indices: np.ndarray, values: np.ndarray, numel: int, value_dtype: str
) -> tuple[Payload, np.ndarray]:
    """(sorted unique int64 ``indices``, fp32 ``values``) → (payload, the values as the decoder will
    see them). Raises InvalidInput on a non-finite selected value (skip the step instead)."""
    nblocks = max(1, -(-numel // BLOCK))
    counts = np.bincount(indices >> BLOCK_SHIFT, minlength=nblocks).astype("<u4")
    local = (indices & (BLOCK - 1)).astype("<u2")
    exp = 0
    if value_dtype == "float16":
        maxabs = float(np.max(np.abs(values))) if len(values) else 0.0
        if not np.isfinite(maxabs):
            raise InvalidInput(
                "the gradient has a non-finite value among the selected ones: skip the step and call "
                "codec.reset() (the residual has taken it in)"
            )
        if maxabs > 0:
            # maxabs = m * 2**e with 0.5 <= m < 1, so maxabs * 2**(15 - e) < 2**15 < fp16 max (65504).
            exp = 15 - int(np.frexp(maxabs)[1])
        wire_values = np.ldexp(values, exp).astype("<f2")
        decoded = np.ldexp(wire_values.astype(np.float32), -exp)
    else:
        wire_values = values.astype("<f4")
        decoded = wire_values
    payload = Payload(
        [memoryview(counts).cast("B"), memoryview(local).cast("B"), memoryview(wire_values).cast("B")],
        {"nnz": len(indices), "exp": exp, "vdtype": value_dtype},
        selected=len(indices),
    )
    return payload, decoded


def unpack_sparse(payload: memoryview, meta: dict[str, Any], numel: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `pack_sparse`: (sorted unique int64 indices, fp32 values); RecordError when the
    payload does not fit its meta."""
    try:
        nnz, exp, vdtype = int(meta["nnz"]), int(meta["exp"]), _VALUE_DTYPES[meta["vdtype"]]
    except (KeyError, TypeError, ValueError):
        raise RecordError(f"sparse gradient chunk has bad meta {meta!r}") from None
    nblocks = max(1, -(-numel // BLOCK))
    offset = 0
    counts = np.frombuffer(check_section(payload, offset, 4 * nblocks, "block counts"), "<u4")
    offset += 4 * nblocks
    local = np.frombuffer(check_section(payload, offset, 2 * nnz, "indices"), "<u2")
    offset += 2 * nnz
    wire_values = np.frombuffer(check_section(payload, offset, vdtype.itemsize * nnz, "values"), vdtype)
    check_end(payload, offset + vdtype.itemsize * nnz)
    if int(counts.sum(dtype=np.int64)) != nnz:
        raise RecordError(
            f"sparse gradient chunk: block counts add up to {counts.sum()}, its header says {nnz}"
        )
    indices = np.repeat(np.arange(nblocks, dtype=np.int64) << BLOCK_SHIFT, counts.astype(np.int64))
    indices += local
    if nnz and (indices[-1] >= numel or not bool(np.all(np.diff(indices) > 0))):
        raise RecordError("sparse gradient chunk: indices out of range or not increasing")
    if vdtype.itemsize == 2:
        values = np.ldexp(wire_values.astype(np.float32), -exp)
    else:
        values = wire_values.astype(np.float32)
    return indices, values


class SparseCodec(CodecState):
    """Shared by ``topk`` and ``dgc``: the wire layout above and per-name error-feedback state.

    Knobs: ``density`` (fraction of elements sent, 0 < density <= 1), ``value_dtype``.
    Internal state: ``residuals[name]`` (fp32, numel elements) and, for DGC, ``momenta[name]``.
    """

    sparse = True

    def __init__(self, *, density: float = 0.01, value_dtype: str = "float16", **common: Any) -> None:
        super().__init__(**common)
        if not isinstance(density, int | float) or not 0 < density <= 1:
            raise InvalidInput(f"density must be in (0, 1], got {density!r}")
        if value_dtype not in _VALUE_DTYPES:
            raise InvalidInput(f"value_dtype must be one of {sorted(_VALUE_DTYPES)}, got {value_dtype!r}")
        self.density = float(density)
        self.value_dtype = value_dtype
        self.residuals: dict[str, np.ndarray] = {}
        self.momenta: dict[str, np.ndarray] = {}

    def knobs(self) -> dict[str, Any]:
        return {**super().knobs(), "density": self.density, "value_dtype": self.value_dtype}

    @classmethod
    def decompress(
        cls, payload: memoryview, meta: dict[str, Any], numel: int
    ) -> tuple[np.ndarray, np.ndarray]:
        return unpack_sparse(payload, meta, numel)

    def reset(self, name: str | None = None) -> None:
        """Forget the error-feedback state of ``name`` (all names when None), e.g. after a non-finite
        gradient got into it. The next encode starts from zero residual and momentum."""
        for store in (self.residuals, self.momenta):
            if name is None:
                store.clear()
            else:
                store.pop(name, None)

    def flush(self, name: str) -> torch.Tensor | None:
        residual = self.residuals.get(name)
        self.reset(name)
        return None if residual is None else torch.from_numpy(residual)

    def _buffer(self, store: dict[str, np.ndarray], name: str, numel: int) -> np.ndarray:
        buf = store.get(name)
        if buf is None or buf.shape[0] != numel:
            if buf is not None:
                # DDP rebuilds its buckets after the first iteration; a residual of another size
                # belongs to other parameters, and carrying it over would be wrong.
                log.warning(
                    "compression state %r changed size %d -> %d: reset to zero", name, buf.shape[0], numel
                )
            buf = store[name] = np.zeros(numel, dtype=np.float32)
        return buf

    def _extra_state(self) -> dict[str, Any]:
        return {
            "residuals": {k: torch.from_numpy(v.copy()) for k, v in self.residuals.items()},
            "momenta": {k: torch.from_numpy(v.copy()) for k, v in self.momenta.items()},
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        def load(d: dict[str, Any]) -> dict[str, np.ndarray]:
            return {k: t.detach().cpu().to(torch.float32).numpy().copy() for k, t in d.items()}

        self.residuals = load(state.get("residuals", {}))
        self.momenta = load(state.get("momenta", {}))


@register_codec("topk")
class TopKCodec(SparseCodec):
    """Exact top-k by magnitude, with error feedback: each step adds the gradient to the residual, sends
    the k = max(1, round(density * numel)) largest-magnitude entries of the sum (exactly k; ties broken
    arbitrarily), and keeps the rest (and the fp16 rounding error) as the new residual.

    ``error_feedback=False`` drops what was not sent (biased; for comparison only). O(n) selection
    (numpy introselect), but several passes: see ``dgc`` for the fast sampled-threshold variant.
    """

    def __init__(self, *, error_feedback: bool = True, **knobs: Any) -> None:
        super().__init__(**knobs)
        self.error_feedback = bool(error_feedback)

    def knobs(self) -> dict[str, Any]:
        return {**super().knobs(), "error_feedback": self.error_feedback}

    def _compress(self, flat: torch.Tensor, name: str, step: int, rng: np.random.Generator) -> Payload:
        g = flat.numpy()
        n = g.shape[0]
        if self.error_feedback:
            acc = self._buffer(self.residuals, name, n)
            acc += g  # in place: the residual becomes residual + gradient
        else:
            acc = g.copy()
        k = min(n, max(1, round(self.density * n)))
        if k == n:
            indices = np.arange(n, dtype=np.int64)
        else:
            indices = np.argpartition(np.abs(acc), n - k)[n - k :]
            indices.sort()
        values = acc[indices]
        payload, decoded = pack_sparse(indices, values, n, self.value_dtype)
        if self.error_feedback:
            acc[indices] = values - decoded  # keep only what the receivers will not see
        return payload
