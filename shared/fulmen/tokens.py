"""Token ids and log-probabilities on the wire: packed little-endian arrays, not msgpack lists.

int32 ids, float32 log-probabilities; `ids` and `floats` read either form into plain lists. Why:
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


def pack_ids(values: Sequence[int] | bytes) -> bytes:
    """int32 little-endian bytes (bytes given are checked and passed through)."""
    if isinstance(values, bytes | bytearray):
        if len(values) % 4:
            raise RecordError("packed token ids must be a multiple of 4 bytes")
        return bytes(values)
    return _packed("i", values)


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
    """Token ids from a span attribute or record field: packed bytes or a list of ints."""
    if isinstance(value, bytes | bytearray):
        return _unpacked("i", bytes(value))
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
