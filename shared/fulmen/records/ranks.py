"""Between trainer ranks: compressed gradient chunks, their header, the leader's step plan, and the
record of a step the ranks agreed on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from fulmen.errors import RecordError
from fulmen.records.base import Record, require, require_at_least, require_nonempty


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
class GradientChunk(Record):
    """One piece of one rank's compressed gradient for one tensor or bucket at one step
    (the trainer's codecs, `fulmen_trainer.distributed.codecs`, write and read these; ``data`` is a slice of the
    codec's payload)."""

    KIND: ClassVar[str] = "grad_chunk"

    fmt: int  # layout version of the codec payloads (fulmen_trainer.distributed.codecs.FORMAT_VERSION)
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

    def check_wire(self) -> None:
        if not all(isinstance(x, int) and x >= 0 for x in self.shape):
            raise RecordError(f"grad_chunk record has a bad shape {self.shape!r}")
        require_at_least(self, 0, "step", "rank", "index", "size")
        require(self, 0 <= self.index < self.count, f"chunk {self.index} of {self.count}")


@dataclass(frozen=True, slots=True)
class RankPlan(Record):
    """The trainer leader's share of one step for one other rank (the leader, any rank -> rank n).

    The rank back-propagates ``epochs`` passes over ``samples`` (`Sample` wire records) with these
    ``advantages`` (packed float32, `fulmen.tokens`), scaling its gradient by its tokens over
    ``total_tokens`` (the whole step's). A rank whose step is not ``step_before`` first loads the
    weights of ``model_version``."""

    KIND: ClassVar[str] = "rank_plan"
    # a step's samples may exceed one sample's limit: a plan carries up to a whole batch
    MAX_BYTES: ClassVar[int] = 64 << 20

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

    def check_wire(self) -> None:
        require_at_least(self, 1, "step", "epochs")
        require_at_least(self, 0, "rank", "total_tokens")  # rank 0 follows too once another rank leads
        require_nonempty(self, "model_version")
        n = len(self.samples)
        require(self, len(self.rewards) == n and len(self.group_keys) == n and len(self.advantages) == 4 * n,
                f"{n} samples but {len(self.rewards)} rewards, {len(self.group_keys)} group keys, "
                f"{len(self.advantages)} bytes of advantages")
        require(self, all(type(s) is bytes for s in self.samples), "samples must be records (bytes)")
        require(self, all(type(r) in (float, int) and math.isfinite(r) for r in self.rewards),
                "rewards must be finite numbers")


@dataclass(frozen=True, slots=True)
class AgreedStep(Record):
    """A step the trainer ranks agreed on, as its leader commits it (one fenced write, only while it
    holds the lease of ``epoch``): the ranks apply the step's last update only once this exists, and a
    new leader resumes from the newest one. ``entry_ids``: the samples-stream entries the step
    consumed; ``summary``: the step's `TrainStep` wire record (the steps stream's, written again by a
    new leader if the old one died before writing it)."""

    KIND: ClassVar[str] = "agreed_step"
    MAX_BYTES: ClassVar[int] = 16 << 20  # the entry ids of a whole batch

    step: int
    epoch: int  # the leader's lease (fencing token)
    rank: int  # the leader's rank
    model_version: str  # the weights after this step (published now, or the version before)
    publishes: bool  # whether ``model_version`` is this step's own new version
    entry_ids: list[str]
    summary: bytes

    def check_wire(self) -> None:
        require_at_least(self, 1, "step", "epoch")
        require_at_least(self, 0, "rank")
        require_nonempty(self, "model_version")
        require(self, all(type(e) is str for e in self.entry_ids), "entry ids must be strings")
