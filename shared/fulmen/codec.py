"""msgpack with a schema version and size limits: the only wire format Fulmen uses (never pickle)."""

from __future__ import annotations

import threading
from typing import Any

import msgpack

from fulmen.errors import RecordError, RecordTooLarge, SchemaVersionError

SCHEMA_VERSION = 1
DEFAULT_MAX_RECORD_BYTES = 8 * 1024 * 1024
_packers = threading.local()  # `packb_kept`'s: a Packer is not thread-safe
KEPT_PACKER_BYTES = 4 * 1024 * 1024  # a Packer that wrote more is not kept (its buffer stays that large)


def pack(value: Any, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
    """Encode a plain value (dict, list, str, bytes, numbers, None, bool)."""
    try:
        data = packb_kept(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise RecordError(f"cannot encode as msgpack: {e}") from e
    return _checked_size(data, max_bytes)


def packb_kept(value: Any, use_bin_type: bool = True) -> bytes:
    """`msgpack.packb` with this thread's Packer, kept between calls: packb sets one up, with a fresh
    256 KiB buffer, each call, and writing that fresh memory was a visible share of the adapter's CPU.
    No ``default`` hook: nothing runs Python code of the caller's while the Packer is in use."""
    name = "bin" if use_bin_type else "raw"
    packer = getattr(_packers, name, None)
    if packer is None:
        packer = msgpack.Packer(use_bin_type=use_bin_type)
        setattr(_packers, name, packer)
    data = packer.pack(value)  # a failed pack leaves the Packer empty
    if len(data) > KEPT_PACKER_BYTES:
        delattr(_packers, name)  # its buffer is as large: not kept
    return data


def _checked_size(data: bytes, max_bytes: int) -> bytes:
    if len(data) > max_bytes:
        raise RecordTooLarge(
            f"record is {len(data):,} bytes, over the {max_bytes:,}-byte limit "
            "(raise FULMEN_MAX_RECORD_BYTES, or keep large payloads out of the record)"
        )
    return data


def unpack(data: bytes, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Any:
    """Decode bytes written by `pack`; anything else raises RecordError, never a crash."""
    if len(data) > max_bytes:
        raise RecordTooLarge(f"record is {len(data):,} bytes, over the {max_bytes:,}-byte limit")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData) as e:
        raise RecordError(f"not a valid msgpack record: {e}") from e


def pack_record(kind: str, fields: dict[str, Any], max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
    """Encode one message record: its fields plus the schema version ``v`` and the record ``kind``."""
    return pack({"v": SCHEMA_VERSION, "kind": kind, **fields}, max_bytes)


def unpack_record(
    data: bytes | None, kind: str, max_bytes: int = DEFAULT_MAX_RECORD_BYTES, required: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Decode one message record of the given kind (a stream entry's ``m`` field); a missing record,
    a wrong version or kind, or a missing ``required`` field is refused with RecordError."""
    if data is None:
        raise RecordError(f"{kind} entry has no 'm' field")
    value = unpack(data, max_bytes)
    if not isinstance(value, dict):
        raise RecordError(f"a {kind} record must be a map, got {type(value).__name__}")
    check_version(value.get("v"), kind)
    if value.get("kind") != kind:
        raise RecordError(f"expected a {kind} record, got kind {value.get('kind')!r}")
    for name in required:
        if name not in value:
            raise RecordError(f"{kind} record has no {name!r}")
    return value


def check_version(version: Any, kind: str) -> None:
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{kind} record has schema version {version!r}; this Fulmen reads version {SCHEMA_VERSION}. "
            "Upgrade Fulmen where it reads, or drain the old records first."
        )
