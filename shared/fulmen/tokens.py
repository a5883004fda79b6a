"""Token ids and log-probabilities on the wire: packed little-endian arrays, not msgpack lists.

Token ids as the byte planes of their int32 values (`pack_ids`; int32 bytes as written before are
read too), float32 log-probabilities; `ids` and `floats` read any of these into plain lists, and
`starts_with`, `tail` and `joined` work on packed ids without unpacking them. Why:
docs/design/records.md; figures: bench/RESULTS.md.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

from fulmen.errors import RecordError

_SWAP = sys.byteorder != "little"  # the wire is little-endian; swap on the rare big-endian host


def _packed(kind: str, values: Sequence[Any]) -> bytes:
    try:
        a = array(kind, values)
    except (TypeError, OverflowError) as e:
        what = "token ids" if kind == "i" else "numbers"
        raise RecordError(f"expected a list of {what}: {e}") from None
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _unpacked(kind: str, data: bytes) -> list[Any]:
    a = array(kind)
    if len(data) % a.itemsize:
        raise RecordError(f"packed array of {len(data)} bytes is not a whole number of {a.itemsize}-byte items")
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a.tolist()


# The last byte of token ids packed as byte planes: n ids take 4n + 1 bytes, int32 ids 4n, so the two
# never read as each other. Either way ``len(packed) // 4`` is the number of ids.
PLANES = 0xF4
_PLANES_END = bytes([PLANES])


def pack_ids(values: Sequence[int] | bytes) -> bytes:
    """Token ids packed as stored: the int32 little-endian values' four byte planes (every id's low
    byte, then every id's second byte, ...), then `PLANES`. The high planes of a vocabulary's ids are
    nearly constant, so zstd stores them in a few bytes without the entropy coding that would make
    reading them slow. Bytes given are checked: planes pass through, int32 (as written before) become planes."""
    if isinstance(values, bytes | bytearray):
        if is_planes(values):
            return bytes(values)
        if len(values) % 4:
            raise RecordError("packed token ids must be byte planes or a multiple of 4 bytes")
        return planes(bytes(values))
    return planes(_packed("i", values))


def is_planes(packed: bytes | bytearray) -> bool:
    return len(packed) % 4 == 1 and packed[-1] == PLANES


def planes(int32: bytes) -> bytes:
    """int32 little-endian ids as byte planes (`pack_ids`)."""
    return b"".join((int32[0::4], int32[1::4], int32[2::4], int32[3::4], _PLANES_END))


def _int32(packed: bytes) -> bytes:
    n = len(packed) // 4
    out = bytearray(4 * n)
    for plane in range(4):
        out[plane::4] = packed[plane * n:(plane + 1) * n]
    return bytes(out)


def starts_with(packed: bytes, prefix: bytes, at: int = 0) -> bool:
    """Whether the ids of ``packed`` from index ``at`` on begin with those of ``prefix`` (both planes)."""
    n, m = len(packed) // 4, len(prefix) // 4
    if at + m > n:
        return False
    return all(packed.startswith(prefix[p * m:(p + 1) * m], p * n + at) for p in range(4))


def tail(packed: bytes, start: int) -> bytes:
    """The ids of ``packed`` (planes) from index ``start`` on, as planes."""
    n = len(packed) // 4
    return b"".join([packed[p * n + start:(p + 1) * n] for p in range(4)] + [_PLANES_END])


def joined(parts: Sequence[bytes]) -> bytes:
    """The ids of ``parts`` (each planes) one after the other, as planes."""
    counts = [len(part) // 4 for part in parts]
    return b"".join([part[p * n:(p + 1) * n] for p in range(4) for part, n in zip(parts, counts, strict=True)]
                    + [_PLANES_END])


def pack_floats(values: Sequence[float] | bytes) -> bytes:
    """float32 little-endian bytes (log-probabilities need no more precision than the model has)."""
    if isinstance(values, bytes | bytearray):
        if len(values) % 4:
            raise RecordError("packed floats must be a multiple of 4 bytes")
        return bytes(values)
    return _packed("f", values)


def pack_mask(values: Sequence[int] | bytes) -> bytes:
    if isinstance(values, bytes | bytearray):
        return bytes(values)
    return _packed("b", values)


def ids(value: Any) -> list[int]:
    """Token ids from a span attribute or record field: packed bytes (`pack_ids`) or a list of ints."""
    if isinstance(value, bytes | bytearray):
        return _unpacked("i", _int32(bytes(value)) if is_planes(value) else bytes(value))
    if isinstance(value, list | tuple):
        _packed("i", value)  # checks every element in C
        return list(value)
    raise RecordError(f"token ids must be packed bytes or a list of ints, not {type(value).__name__}")


def floats(value: Any) -> list[float]:
    if isinstance(value, bytes | bytearray):
        return _unpacked("f", bytes(value))
    if isinstance(value, list | tuple):
        return array("d", value).tolist() if value else []
    raise RecordError(f"expected packed float32 bytes or a list of numbers, not {type(value).__name__}")


def mask(value: Any) -> list[int]:
    if isinstance(value, bytes | bytearray):
        return _unpacked("b", bytes(value))
    if isinstance(value, list | tuple):
        _packed("b", value)  # checks every element in C
        return list(value)
    raise RecordError(f"a mask must be packed bytes or a list of ints, not {type(value).__name__}")
