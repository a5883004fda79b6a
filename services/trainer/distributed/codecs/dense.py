"""Dense codecs: ``none`` (fp32, lossless) and ``bf16`` (round to nearest even, 2×).

Neither keeps error feedback: ``none`` loses nothing, and bf16's rounding error is unbiased enough
that the usual practice (PyTorch's ``bf16_compress_hook``) does without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fulmen_trainer.distributed.codecs.base import CodecState, check_end, check_section, register_codec
from fulmen_trainer.distributed.codecs.framing import Payload


@register_codec("none")
class NoneCodec(CodecState):
    """fp32 as is: 4 bytes an element, lossless. Payload: the little-endian fp32 bytes."""

    lossless = True

    def _compress(self, flat: torch.Tensor, name: str, step: int, rng: np.random.Generator) -> Payload:
        # A view of the caller's memory, no copy: framing copies each slice once into its record.
        return Payload([memoryview(flat.numpy()).cast("B")])

    @classmethod
    def decompress(cls, payload: memoryview, meta: dict[str, Any], numel: int) -> np.ndarray:
        data = check_section(payload, 0, 4 * numel, "fp32 values")
        check_end(payload, 4 * numel)
        return np.frombuffer(data, dtype="<f4")


@register_codec("bf16")
class Bf16Codec(CodecState):
    """bfloat16, round to nearest even: 2 bytes an element, fp32's range, 8 significant bits.
    Payload: the bf16 bit patterns as little-endian int16. Exact for bf16-representable values."""

    def _compress(self, flat: torch.Tensor, name: str, step: int, rng: np.random.Generator) -> Payload:
        bits = flat.to(torch.bfloat16).view(torch.int16).numpy()
        return Payload([memoryview(bits).cast("B")])

    @classmethod
    def decompress(cls, payload: memoryview, meta: dict[str, Any], numel: int) -> np.ndarray:
        data = check_section(payload, 0, 2 * numel, "bf16 values")
        check_end(payload, 2 * numel)
        # bf16 is the top half of an fp32: widen the bit pattern and shift it into place.
        wide = np.frombuffer(data, dtype="<u2").astype(np.uint32)
        wide <<= 16
        return wide.view(np.float32)
