"""Chunk framing: a codec payload ↔ a list of `fulmen.records.GradientChunk` wire records.

The bottom of the codec package: it imports no codec. `unframe` refuses, with RecordError, anything
but the chunks of one payload in order. The header and checks: docs/design/trainer.md.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fulmen.codec import DEFAULT_MAX_RECORD_BYTES
from fulmen.errors import RecordError
from fulmen.records import GradientChunk, GradientHeader

FORMAT_VERSION = 1  # layout of every codec payload; bump on any change, old chunks are then refused

# Room for the header: the fixed fields take ~120 bytes; a long name or a large meta map is refused
# by the record size check rather than silently split.
_HEADER_ROOM = 16 * 1024


@dataclass(slots=True)
class Payload:
    """A codec's output before framing: byte sections laid end to end, and the small ``meta`` map the
    decoder needs (it travels in every chunk header)."""

    sections: list[memoryview | bytes]
    meta: dict[str, Any] = field(default_factory=dict)
    selected: int | None = None  # elements actually sent (sparse codecs), for statistics

    @property
    def nbytes(self) -> int:
        return sum(memoryview(s).nbytes for s in self.sections)


def frame(
    payload: Payload,
    *,
    codec: str,
    step: int,
    rank: int,
    name: str,
    shape: list[int],
    dtype: str,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> list[bytes]:
    """Split ``payload`` into chunks of at most ``max_record_bytes`` each, header included."""
    # One contiguous buffer to slice: zero-copy when the codec made a single section (fp32, bf16).
    if len(payload.sections) == 1:
        data = memoryview(payload.sections[0]).cast("B")
    else:
        data = memoryview(b"".join(payload.sections))
    size = data.nbytes
    per_chunk = max_record_bytes - _HEADER_ROOM
    count = max(1, -(-size // per_chunk))
    chunks = []
    for index in range(count):
        piece = data[index * per_chunk : (index + 1) * per_chunk]
        record = GradientChunk(
            fmt=FORMAT_VERSION,
            step=step,
            rank=rank,
            name=name,
            codec=codec,
            shape=shape,
            dtype=dtype,
            meta=payload.meta,
            index=index,
            count=count,
            size=size,
            crc32=zlib.crc32(piece),
            data=piece,
        )
        chunks.append(record.to_wire(max_record_bytes))
    return chunks


def parse_chunk(
    chunk: bytes | GradientChunk, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> GradientChunk:
    """One wire record → GradientChunk (already parsed ones pass through); checks version and crc."""
    record = chunk if isinstance(chunk, GradientChunk) else GradientChunk.from_wire(chunk, max_record_bytes)
    where = f"gradient chunk {record.index} of {record.name!r} (rank {record.rank}, step {record.step})"
    if record.fmt != FORMAT_VERSION:
        raise RecordError(
            f"{where} has payload format {record.fmt}; this Fulmen reads format {FORMAT_VERSION}"
        )
    if zlib.crc32(record.data) != record.crc32:
        raise RecordError(f"{where} is corrupted: crc32 mismatch")
    return record


def unframe(
    chunks: Sequence[bytes | GradientChunk], max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> tuple[GradientHeader, memoryview]:
    """The chunks of one payload, in order → (header, payload bytes). See the module docstring."""
    if not chunks:
        raise RecordError("no gradient chunks to decode")
    records = [parse_chunk(c, max_record_bytes) for c in chunks]
    first = records[0]
    header = first.header
    if first.count != len(records):
        raise RecordError(
            f"gradient {first.name!r} (rank {first.rank}, step {first.step}) has {first.count} chunks, "
            f"got {len(records)}: a chunk is missing or extra"
        )
    for position, r in enumerate(records):
        if r.index != position:
            raise RecordError(
                f"gradient {first.name!r} (rank {first.rank}, step {first.step}): expected chunk {position}, "
                f"got chunk {r.index} (out of order, duplicated or missing)"
            )
        if r.header != header or r.count != first.count:
            raise RecordError(
                f"chunk {r.index} belongs to gradient {r.name!r} (rank {r.rank}, step {r.step}), not to "
                f"{first.name!r} (rank {first.rank}, step {first.step}): chunks of different gradients mixed"
            )
    total = sum(len(r.data) for r in records)
    if total != header.size:
        raise RecordError(
            f"gradient {first.name!r} (rank {first.rank}, step {first.step}) payload is {total} bytes, "
            f"its header says {header.size}: truncated"
        )
    if len(records) == 1:
        return header, memoryview(records[0].data)
    # One copy into a writable buffer: decoders may then hand out views of it without copying again.
    data = bytearray(total)
    position = 0
    for r in records:
        data[position : position + len(r.data)] = r.data
        position += len(r.data)
    return header, memoryview(data)

