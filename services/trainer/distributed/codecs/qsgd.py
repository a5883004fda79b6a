"""``qsgd8`` and ``qsgd4``: QSGD stochastic quantisation (Alistarh et al., NeurIPS 2017), unbiased.

No error feedback; each rank draws from its own seeded stream. The levels, the norms and the wire
layout: docs/design/trainer.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from fulmen.errors import InvalidInput, RecordError
from fulmen_trainer.distributed.codecs.base import CodecState, check_end, check_section, register_codec
from fulmen_trainer.distributed.codecs.framing import Payload

_NORMS = ("max", "l2")


class QSGDCodec(CodecState):
    """Shared implementation; ``bits`` is fixed by the registered subclass."""

    bits: ClassVar[int] = 8

    def __init__(self, *, bucket_size: int = 512, norm: str = "max", **knobs: Any) -> None:
        super().__init__(**knobs)
        if not isinstance(bucket_size, int) or bucket_size < 2 or bucket_size % 2:
            raise InvalidInput(f"bucket_size must be an even int >= 2, got {bucket_size!r}")
        if norm not in _NORMS:
            raise InvalidInput(f"norm must be one of {_NORMS}, got {norm!r}")
        self.bucket_size = bucket_size
        self.norm = norm

    @property
    def levels(self) -> int:
        return (1 << (self.bits - 1)) - 1  # 127 or 7: symmetric, so 0 is exact and -s..s all fit

    def knobs(self) -> dict[str, Any]:
        return {**super().knobs(), "bucket_size": self.bucket_size, "norm": self.norm}

    def _compress(self, flat: torch.Tensor, name: str, step: int, rng: np.random.Generator) -> Payload:
        x = flat.numpy()
        n, b, s = x.shape[0], self.bucket_size, self.levels
        nbuckets = max(1, -(-n // b))
        if nbuckets * b != n:  # pad the last bucket with zeros (not sent)
            x = np.concatenate([x, np.zeros(nbuckets * b - n, dtype=np.float32)])
        x = x.reshape(nbuckets, b)
        if self.norm == "max":
            norms = np.max(np.abs(x), axis=1)
        else:
            norms = np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64)).astype(np.float32)
        if not np.all(np.isfinite(norms)):
            raise InvalidInput("the gradient has a non-finite value: skip this step")
        with np.errstate(divide="ignore"):
            scale = np.where(norms > 0, np.float32(s) / norms, np.float32(0)).astype(np.float32)
        # y = x * s / N + U, in place on one fresh buffer; floor(y) is the unbiased stochastic rounding.
        y = rng.random((nbuckets, b), dtype=np.float32)
        y += x * scale[:, None]
        np.floor(y, out=y)
        np.clip(y, -s, s, out=y)  # |x| * s / N can round a hair above s
        q = y.reshape(-1)[:n].astype(np.int8)
        if self.bits == 4:
            codes = (q + 8).astype(np.uint8)
            if n % 2:
                codes = np.concatenate([codes, np.zeros(1, dtype=np.uint8)])
            packed = (codes[0::2] << 4) | codes[1::2]
        else:
            packed = q
        return Payload(
            [memoryview(norms.astype("<f4")).cast("B"), memoryview(packed).cast("B")],
            {"bucket": b, "levels": s},
        )

    @classmethod
    def decompress(cls, payload: memoryview, meta: dict[str, Any], numel: int) -> np.ndarray:
        try:
            b, s = int(meta["bucket"]), int(meta["levels"])
        except (KeyError, TypeError, ValueError):
            raise RecordError(f"qsgd gradient chunk has bad meta {meta!r}") from None
        if b < 2 or s != (1 << (cls.bits - 1)) - 1:
            raise RecordError(f"qsgd{cls.bits} gradient chunk has bad meta {meta!r}")
        nbuckets = max(1, -(-numel // b))
        norms = np.frombuffer(check_section(payload, 0, 4 * nbuckets, "bucket norms"), "<f4")
        ncodes = numel if cls.bits == 8 else -(-numel // 2)
        raw = check_section(payload, 4 * nbuckets, ncodes, "codes")
        check_end(payload, 4 * nbuckets + ncodes)
        if cls.bits == 8:
            q = np.frombuffer(raw, np.int8)
        else:
            packed = np.frombuffer(raw, np.uint8)
            q = np.empty(2 * len(packed), dtype=np.int8)
            q[0::2] = packed >> 4
            q[1::2] = packed & 0x0F
            q -= 8
            q = q[:numel]
        out = np.zeros(nbuckets * b, dtype=np.float32)
        out[:numel] = q
        out = out.reshape(nbuckets, b)
        out *= (norms / np.float32(s))[:, None]
        return out.reshape(-1)[:numel]


@register_codec("qsgd8")
class QSGD8Codec(QSGDCodec):
    """QSGD with 8-bit codes (levels -127..127): ~4× smaller, unbiased."""

    bits = 8


@register_codec("qsgd4")
class QSGD4Codec(QSGDCodec):
    """QSGD with 4-bit codes (levels -7..7), two a byte: ~8× smaller, unbiased, higher variance."""

    bits = 4
