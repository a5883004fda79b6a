"""Decoding and aggregation: pure bytes in, fp32 tensors out (the trainer does the Redis I/O).

`sum_decoded` sums every rank's decoded chunks (its own included) in fp32 in rank order;
`mean_decoded` divides by their count. ``out`` is overwritten in place; inputs are never modified.
Why: docs/design/trainer.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fulmen.codec import DEFAULT_MAX_RECORD_BYTES
from fulmen.errors import InvalidInput, RecordError
from fulmen.records import GradientChunk, GradientHeader
from fulmen_trainer.distributed.codecs.base import CodecStats, codec_class
from fulmen_trainer.distributed.codecs.framing import unframe

Chunks = Sequence[bytes | GradientChunk]


@dataclass(frozen=True, slots=True)
class DecodedGradient:
    """One rank's decoded gradient: ``dense`` (fp32, numel) or, for sparse codecs, ``indices``
    (int64, unique, increasing) and ``values`` (fp32) over a flat gradient of ``header.numel``."""

    header: GradientHeader
    dense: np.ndarray | None = None
    indices: np.ndarray | None = None
    values: np.ndarray | None = None

    def add_to(self, out: np.ndarray) -> None:
        """``out += self`` in place (``out`` flat fp32 of numel elements)."""
        if self.dense is not None:
            out += self.dense
        else:
            out[self.indices] += self.values  # unique indices: a fancy-index add is exact


def decode_parts(chunks: Chunks, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> DecodedGradient:
    """The chunks of one rank's gradient, in order → DecodedGradient (RecordError if anything is off)."""
    header, payload = unframe(chunks, max_record_bytes)
    cls = codec_class(header.codec)
    result = cls.decompress(payload, header.meta, header.numel)
    if cls.sparse:
        indices, values = result
        return DecodedGradient(header, indices=indices, values=values)
    return DecodedGradient(header, dense=result)


def decode(
    chunks: Chunks, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, *, stats: CodecStats | None = None
) -> torch.Tensor:
    """The chunks of one rank's gradient, in order → a new dense fp32 tensor of the encoded shape.
    ``stats`` (a codec's `CodecStats`): count this decode and its time there."""
    started = time.perf_counter()
    out = _dense(decode_parts(chunks, max_record_bytes))
    if stats is not None:
        stats.decode_s += time.perf_counter() - started
        stats.decode_calls += 1
    return out


def _dense(part: DecodedGradient) -> torch.Tensor:
    if part.dense is not None:
        dense = part.dense if part.dense.flags.writeable else part.dense.copy()
        out = torch.from_numpy(dense)
    else:
        out = torch.zeros(part.header.numel, dtype=torch.float32)
        part.add_to(out.numpy())
    return out.view(part.header.shape)


def sum_decoded(
    chunk_lists: Sequence[Chunks],
    out: torch.Tensor | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> torch.Tensor:
    """Sum of the decoded gradients of several ranks (one chunk list each) for one tensor and step.

    Summed in fp32 in increasing rank order whatever the order given (so every rank computes the same
    bits). Refuses (RecordError) lists for different names, shapes or steps, or a rank twice.
    ``out`` (fp32, contiguous, same numel) is overwritten and returned; else a new tensor.
    """
    if not chunk_lists:
        raise InvalidInput("sum_decoded needs at least one rank's chunks")
    parts = sorted((decode_parts(c, max_record_bytes) for c in chunk_lists), key=lambda p: p.header.rank)
    first = parts[0].header
    ranks = [p.header.rank for p in parts]
    if len(set(ranks)) != len(ranks):
        raise RecordError(f"gradient {first.name!r} step {first.step}: a rank appears twice in {ranks}")
    for p in parts[1:]:
        h = p.header
        if (h.name, h.shape, h.step) != (first.name, first.shape, first.step):
            raise RecordError(
                f"cannot add gradient {h.name!r} {list(h.shape)} step {h.step} (rank {h.rank}) to "
                f"{first.name!r} {list(first.shape)} step {first.step} (rank {first.rank})"
            )
    if out is None:
        out = torch.zeros(first.shape, dtype=torch.float32)
    else:
        if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
            raise InvalidInput("out must be a contiguous float32 CPU tensor")
        if out.numel() != first.numel:
            raise InvalidInput(f"out has {out.numel()} elements, the gradient {first.numel}")
        out.zero_()
    flat = out.detach().view(-1).numpy()
    for p in parts:
        p.add_to(flat)
    return out


def mean_decoded(
    chunk_lists: Sequence[Chunks],
    out: torch.Tensor | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> torch.Tensor:
    """`sum_decoded` divided by the number of ranks given (the world size): the data-parallel average."""
    total = sum_decoded(chunk_lists, out, max_record_bytes)
    return total.div_(len(chunk_lists))
