"""Between trainer ranks: compressed gradient chunks, their header, and the leader's step plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fulmen.codec import (
    DEFAULT_MAX_RECORD_BYTES,
    pack_record,
    unpack_record,
)
from fulmen.errors import RecordError


@dataclass(frozen=True, slots=True)
class GradientHeader:
    """What every chunk of one framed gradient payload agrees on (`GradientChunk.header`)."""

    step: int
    rank: int
    name: str  # the tensor or bucket this gradient belongs to
    codec: str
    shape: tuple[int, ...]
    dtype: str
    meta: dict[str, Any]
    size: int  # bytes in the whole payload

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class GradientChunk:
    """One piece of one rank's compressed gradient for one tensor or bucket at one step
    (the trainer's codecs, `fulmen_trainer.codecs`, write and read these; ``data`` is a slice of the
    codec's payload)."""

    fmt: int  # layout version of the codec payloads (fulmen_trainer.codecs.FORMAT_VERSION)
    step: int
    rank: int
    name: str  # the tensor or bucket this gradient belongs to
    codec: str  # registered codec name ("none", "bf16", "topk", "dgc", "qsgd8", "qsgd4")
    shape: list[int]  # of the gradient before encoding
    dtype: str  # of the gradient before encoding ("float32"); decoding always gives float32
    meta: dict[str, Any]  # what the codec needs to decode the payload (nnz, scale exponent, bucket size...)
    index: int  # 0-based position of this chunk
    count: int  # chunks in the whole payload
    size: int  # bytes in the whole payload
    crc32: int  # zlib.crc32 of this chunk's data
    data: bytes | memoryview

    @property
    def header(self) -> GradientHeader:
        return GradientHeader(
            self.step, self.rank, self.name, self.codec, tuple(self.shape), self.dtype, self.meta, self.size
        )

    def to_wire(self, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
        return pack_record("grad_chunk", {name: getattr(self, name) for name in self.__slots__}, max_bytes)

    @classmethod
    def from_wire(cls, data: bytes | None, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> GradientChunk:
        names = cls.__slots__
        d = unpack_record(data, "grad_chunk", max_bytes, required=names)
        types = (int, int, int, str, str, list, str, dict, int, int, int, int, bytes)
        if not all(isinstance(d[n], t) for n, t in zip(names, types, strict=True)):
            raise RecordError("grad_chunk record has a field of the wrong type")
        if not all(isinstance(x, int) and x >= 0 for x in d["shape"]):
            raise RecordError(f"grad_chunk record has a bad shape {d['shape']!r}")
        return cls(*(d[n] for n in names))


@dataclass(frozen=True, slots=True)
class RankPlan:
    """The trainer leader's share of one step for one other rank (trainer rank 0 -> rank n).

    The rank back-propagates ``epochs`` passes over ``samples`` (`Sample` wire records) with these
    ``advantages`` (packed float32, `fulmen.tokens`), scaling its gradient by its tokens over
    ``total_tokens`` (the whole step's). A rank whose step is not ``step_before`` first loads the
    weights of ``model_version``."""

    step: int  # the step being made (step_before + 1)
    rank: int  # the rank this share is for
    step_before: int
    model_version: str
    total_tokens: int
    epochs: int
    samples: list[bytes]
    advantages: bytes
    rewards: list[float]
    group_keys: list[str]

    # a step's samples may exceed one sample's limit: a plan carries up to a whole batch
    MAX_BYTES = 64 << 20

    def to_wire(self) -> bytes:
        return pack_record("rank_plan", {name: getattr(self, name) for name in self.__slots__}, self.MAX_BYTES)

    @classmethod
    def from_wire(cls, data: bytes | None) -> RankPlan:
        names = cls.__slots__
        d = unpack_record(data, "rank_plan", cls.MAX_BYTES, required=names)
        types = (int, int, int, str, int, int, list, bytes, list, list)
        if not all(isinstance(d[n], t) for n, t in zip(names, types, strict=True)):
            raise RecordError("rank_plan record has a field of the wrong type")
        return cls(*(d[n] for n in names))
