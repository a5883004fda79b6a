"""Token ids on the wire: byte planes written, int32 (as written before) still read, and the operations
on packed ids (prefix, tail, join) agree with the same operations on lists."""

from __future__ import annotations

import random
from array import array

import pytest

from fulmen import tokens
from fulmen.errors import RecordError


def test_ids_round_trip_as_planes_and_int32_written_before_still_reads() -> None:
    ids = [0, 1, 255, 256, 65_535, 65_536, 151_645, 2**31 - 1]
    packed = tokens.pack_ids(ids)
    assert len(packed) == 4 * len(ids) + 1 and packed[-1] == tokens.PLANES
    assert packed[:len(ids)] == bytes(i & 0xFF for i in ids)  # the low bytes first
    assert tokens.ids(packed) == ids
    assert tokens.ids(array("i", ids).tobytes()) == ids
    assert tokens.pack_ids(array("i", ids).tobytes()) == packed  # int32 given become planes
    assert tokens.pack_ids(packed) == packed  # bytes pass through
    assert tokens.ids(tokens.pack_ids([])) == []


@pytest.mark.parametrize("bad", [b"\x01\x02\x03", b"\x01\x02\x03\x04\x05", b"\x01" * 6])
def test_packed_ids_of_neither_form_are_refused(bad: bytes) -> None:
    with pytest.raises(RecordError):
        tokens.pack_ids(bad)
    with pytest.raises(RecordError):
        tokens.ids(bad)


def test_prefix_tail_and_join_agree_with_lists() -> None:
    rng = random.Random(7)
    for _ in range(300):
        a = [rng.randrange(200_000) for _ in range(rng.randrange(0, 9))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 3))]
        at = rng.randrange(0, len(a) + 2)
        pa, pb = tokens.pack_ids(a), tokens.pack_ids(b)
        assert tokens.starts_with(pa, pb) == (a[:len(b)] == b)
        assert tokens.starts_with(pa, pb, at) == (at + len(b) <= len(a) and a[at:at + len(b)] == b)
        assert tokens.ids(tokens.tail(pa, min(at, len(a)))) == a[at:]
        assert tokens.ids(tokens.joined([pa, pb, pa])) == a + b + a
