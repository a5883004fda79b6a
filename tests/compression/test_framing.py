"""Chunk framing: size limit respected, and every damaged chunk list refused with a clear RecordError."""

from __future__ import annotations

import msgpack
import pytest
import torch

from fulmen.codec import DEFAULT_MAX_RECORD_BYTES
from fulmen.errors import RecordError, SchemaVersionError
from fulmen.records import GradientChunk
from fulmen_trainer.distributed.codecs import decode, make_codec, mean_decoded, sum_decoded

SMALL = 64 * 1024 + 16 * 1024  # a record limit that forces several chunks on small tensors


def chunks_of(codec: str = "none", n: int = 50_000, **kw) -> tuple[torch.Tensor, list[bytes]]:
    g = torch.randn(n)
    return g, make_codec(codec, max_record_bytes=SMALL, **kw).encode(g, name="layer.0", step=4, rank=1)


def rewrite(chunk: bytes, **fields) -> bytes:
    d = msgpack.unpackb(chunk, raw=False)
    d.update(fields)
    return msgpack.packb(d, use_bin_type=True)


def test_large_payload_is_chunked_under_the_limit() -> None:
    """A 100,000-element fp32 gradient becomes several chunks, each within the record limit."""
    g, chunks = chunks_of(n=100_000)
    assert len(chunks) > 4
    assert all(len(c) <= SMALL for c in chunks)
    assert torch.equal(decode(chunks), g)


def test_default_limit_is_8_mib() -> None:
    """With the default limit, chunks stay under fulmen.codec's 8 MiB."""
    chunks = make_codec("none").encode(torch.zeros(3 << 20))  # 12 MiB
    assert len(chunks) == 2 and all(len(c) <= DEFAULT_MAX_RECORD_BYTES for c in chunks)


def test_header_fields() -> None:
    """Every chunk says step, rank, name, codec, shape, dtype, index/count and its crc."""
    _, chunks = chunks_of("dgc", warmup_steps=0)
    record = GradientChunk.from_wire(chunks[0])
    assert (record.step, record.rank, record.name, record.codec) == (4, 1, "layer.0", "dgc")
    assert (record.shape, record.dtype, record.index, record.count) == ([50_000], "float32", 0, 1)


def test_corrupted_chunk_refused() -> None:
    """A flipped byte in the data fails the crc32 check."""
    _, chunks = chunks_of()
    bad = bytearray(chunks[1])
    bad[-10] ^= 0xFF
    with pytest.raises(RecordError, match="corrupted: crc32 mismatch"):
        decode([chunks[0], bytes(bad), *chunks[2:]])


def test_truncated_chunk_refused() -> None:
    """A record cut short is not valid msgpack; a data field cut short fails the size check."""
    _, chunks = chunks_of()
    with pytest.raises(RecordError, match="not a valid msgpack record"):
        decode([chunks[0][:-100], *chunks[1:]])
    last = GradientChunk.from_wire(chunks[-1])
    short = last.data[:-8]
    import zlib

    cut = rewrite(chunks[-1], data=short, crc32=zlib.crc32(short))
    with pytest.raises(RecordError, match="truncated"):
        decode([*chunks[:-1], cut])


def test_missing_chunk_refused() -> None:
    """One chunk fewer than the header's count is refused."""
    _, chunks = chunks_of()
    with pytest.raises(RecordError, match="missing"):
        decode(chunks[:-1])
    with pytest.raises(RecordError, match="missing or extra"):
        decode([chunks[0], *chunks[2:]])


def test_out_of_order_chunk_refused() -> None:
    """Chunks must come in index order."""
    _, chunks = chunks_of()
    with pytest.raises(RecordError, match="expected chunk 0, got chunk 1"):
        decode([chunks[1], chunks[0], *chunks[2:]])


def test_wrong_versions_refused() -> None:
    """Another record schema version or payload format is refused, never misread."""
    _, chunks = chunks_of()
    with pytest.raises(SchemaVersionError, match="schema version"):
        decode([rewrite(chunks[0], v=99), *chunks[1:]])
    with pytest.raises(RecordError, match="payload format 99"):
        decode([rewrite(chunks[0], fmt=99), *chunks[1:]])


def test_mixed_gradients_refused() -> None:
    """Chunks of two different gradients in one list are refused."""
    _, a = chunks_of()
    b = make_codec("none", max_record_bytes=SMALL).encode(torch.randn(50_000), name="layer.0", step=5, rank=1)
    with pytest.raises(RecordError, match="different gradients mixed"):
        decode([a[0], *b[1:]])


def test_payload_not_matching_meta_refused() -> None:
    """A sparse payload whose header claims another nnz is refused (even with a valid crc)."""
    _, chunks = chunks_of("topk")
    record = msgpack.unpackb(chunks[0], raw=False)
    with pytest.raises(RecordError, match="payload"):
        decode([rewrite(chunks[0], meta={**record["meta"], "nnz": record["meta"]["nnz"] + 1})])


def test_not_a_gradient_chunk_refused() -> None:
    """A record of another kind, or garbage, is refused."""
    with pytest.raises(RecordError):
        decode([b"\x00\x01garbage"])
    with pytest.raises(RecordError, match="expected a grad_chunk record"):
        decode([msgpack.packb({"v": 1, "kind": "sample"})])


def test_sum_and_mean_across_ranks() -> None:
    """sum_decoded adds ranks in rank order (any input order); mean divides by the number of ranks."""
    grads = [torch.randn(70_000) for _ in range(3)]
    lists = [
        make_codec("dgc", warmup_steps=0, seed=0).encode(g, name="w", step=0, rank=r)
        for r, g in enumerate(grads)
    ]
    dense = [decode(c) for c in lists]
    expected = dense[0] + dense[1] + dense[2]
    assert torch.equal(sum_decoded(lists[::-1]), expected)
    out = torch.full((70_000,), 7.0)
    assert mean_decoded(lists, out=out) is out
    assert torch.equal(out, expected / 3)


def test_sum_refuses_mismatched_ranks() -> None:
    """Two lists from one rank, or for different steps, are refused."""
    g = torch.randn(1000)
    a = make_codec("none").encode(g, name="w", step=0, rank=0)
    b = make_codec("none").encode(g, name="w", step=1, rank=1)
    with pytest.raises(RecordError, match="twice"):
        sum_decoded([a, a])
    with pytest.raises(RecordError, match="cannot add"):
        sum_decoded([a, b])


def test_parsed_chunks_are_accepted() -> None:
    """decode takes GradientChunk objects as well as wire bytes (no double parsing in the trainer)."""
    g, chunks = chunks_of()
    assert torch.equal(decode([GradientChunk.from_wire(c) for c in chunks]), g)
