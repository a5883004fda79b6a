"""Spans: what the runner and the proxy record of an attempt, and the adapter's cheap view of them."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import zstandard

from fulmen.codec import DEFAULT_MAX_RECORD_BYTES, SCHEMA_VERSION, check_version, pack, unpack
from fulmen.errors import RecordError, RecordTooLarge


@dataclass(frozen=True, slots=True)
class Span:
    """One OpenTelemetry-shaped span bound to an attempt. The store assigns ``sequence_id``."""

    rollout_id: str
    attempt_id: str
    span_id: str
    name: str
    trace_id: str = ""
    parent_id: str | None = None
    start_time: float | None = None
    end_time: float | None = None
    status_code: str = "UNSET"
    status_message: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)
    sequence_id: int = 0  # 0 until stored

    def to_wire(self, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
        record = [SCHEMA_VERSION, "span", self.rollout_id, self.attempt_id, self.span_id, self.parent_id,
                  self.name, self.start_time, self.end_time, self.attributes, self.trace_id, self.status_code,
                  self.status_message, self.events, self.links, self.resource]
        n = len(record)
        while n > _REQUIRED and record[n - 1] == _OPTIONAL_DEFAULTS[n - 1 - _REQUIRED]:
            n -= 1
        return pack(record[:n], max_bytes)

    @classmethod
    def from_wire(cls, data: bytes, sequence_id: int, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Span:
        (rollout_id, attempt_id, span_id, parent_id, name, start_time, end_time, attributes, trace_id, status_code,
         status_message, events, links, resource) = _fields(unpack(data, max_bytes))
        return cls(rollout_id, attempt_id, span_id, name, trace_id, parent_id, start_time, end_time, status_code,
                   status_message, attributes, events, links, resource, sequence_id)


# The wire form: [v, "span", rollout_id, attempt_id, span_id, parent_id, name, start_time, end_time,
# attributes, trace_id, status_code, status_message, events, links, resource], the trailing fields
# left out while they hold their defaults. Positional, not a map like the other records: the adapter
# decodes every span of every finished rollout, and a map's keys (each a new string to intern) would
# be a large share of decoding one.
_WIRE_FIELDS = ("rollout_id", "attempt_id", "span_id", "parent_id", "name", "start_time", "end_time", "attributes",
                "trace_id", "status_code", "status_message", "events", "links", "resource")
_REQUIRED = 10  # v, kind and the fields through attributes
_MOST = 2 + len(_WIRE_FIELDS)


def _fresh_defaults() -> tuple[Any, ...]:
    """trace_id, status_code, status_message, events, links, resource when left out: new lists and
    dicts each time, so no two spans share one."""
    return "", "UNSET", "", [], [], {}


_OPTIONAL_DEFAULTS = _fresh_defaults()  # to compare with when writing
_TIMES = frozenset({float, int, type(None)})


def _fields(record: Any) -> tuple[Any, ...]:
    """The 14 fields of a decoded span record in wire order, defaults filled in; RecordError (or
    SchemaVersionError) for anything that is not a span record of this version."""
    if not isinstance(record, list | tuple) or len(record) < 2:
        raise RecordError(f"a span record must be an array, got {type(record).__name__}")
    if record[0] != SCHEMA_VERSION:
        check_version(record[0], "span")
    if record[1] != "span":
        raise RecordError(f"expected a span record, got kind {record[1]!r}")
    if not _REQUIRED <= len(record) <= _MOST:
        raise RecordError(f"span record has {len(record) - 2} fields, expected 8 to {len(_WIRE_FIELDS)}")
    fields = tuple(record[2:]) + _fresh_defaults()[len(record) - _REQUIRED:]
    _check_types(fields[2], fields[3], fields[4], fields[5], fields[6], fields[7])
    return fields


def _check_types(span_id: Any, parent_id: Any, name: Any, start_time: Any, end_time: Any, attributes: Any) -> None:
    """What walking a span tree relies on: ids and name strings, times numbers, attributes a map."""
    if (type(span_id) is not str or type(name) is not str or type(attributes) is not dict
            or not (parent_id is None or type(parent_id) is str)
            or type(start_time) not in _TIMES or type(end_time) not in _TIMES):
        raise RecordError("span record has a span_id, parent_id, name, time or attributes of the wrong type")


_new_tuple = tuple.__new__


class SpanView(NamedTuple):
    """The parts of a stored span record that walking an attempt's span tree needs (the adapter):
    ids, name, times, attributes, with the store's sequence id. Same attribute names as `Span`.

    The adapter reads every span of every finished rollout: building a frozen 15-field `Span` would
    cost more than decoding the record, so this is a tuple made straight from the decoded record, and `from_wire` decodes in one msgpack call (tuples for arrays, which are cheaper
    than lists) and checks only what the store does not guarantee: the schema version, the kind, and
    the types of the fields used here."""

    rollout_id: str
    attempt_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_time: float | None
    end_time: float | None
    attributes: dict[str, Any]
    sequence_id: int

    @classmethod
    def from_wire(cls, data: bytes, sequence_id: int, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> SpanView:
        """Decode a span record as `Span.from_wire` would (RecordError for anything it would refuse,
        SchemaVersionError for another version), keeping only the fields above."""
        if len(data) > max_bytes:
            unpack(data, max_bytes)  # raises RecordTooLarge with the usual message
        try:
            d = msgpack.unpackb(data, use_list=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise RecordError(f"not a valid msgpack record: {e}") from e
        return _new_tuple(cls, (*_fields(d)[:8], sequence_id))

    @classmethod
    def from_entries(cls, entries: Iterable[Any], max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> list[SpanView]:
        """A span stream's entries as XREAD returns them (``[id, [field, value, ...]]``; see
        `entry_records` for what one entry holds), as views in sequence order; RecordError if any
        entry is unreadable.

        The loop inlines the common case of `from_wire` (a positional record of this version with
        well-typed fields; anything else goes through `from_wire`, which says what is wrong): a call
        per span would be a large share of the decoding."""
        views = []
        unpackb, new_tuple = msgpack.unpackb, _new_tuple
        try:
            for entry_id, fields in entries:
                sequence_id, records = _entry_batch(entry_id, fields)
                for record in records:
                    sequence_id += 1
                    try:
                        d = unpackb(record, use_list=False, strict_map_key=False) if len(record) <= max_bytes else None
                    except (ValueError, TypeError, msgpack.UnpackException):
                        d = None  # `from_wire` below says what is wrong
                    if type(d) is tuple and _REQUIRED <= len(d) <= _MOST and d[0] == SCHEMA_VERSION and d[1] == "span":
                        _, _, rollout_id, attempt_id, span_id, parent_id, name, start_time, end_time, attributes = (
                            d[:_REQUIRED])
                        if (type(span_id) is str and type(name) is str and type(attributes) is dict
                                and (parent_id is None or type(parent_id) is str)
                                and type(start_time) in _TIMES and type(end_time) in _TIMES):
                            views.append(new_tuple(cls, (rollout_id, attempt_id, span_id, parent_id, name, start_time,
                                                         end_time, attributes, sequence_id)))
                            continue
                    views.append(cls.from_wire(record, sequence_id, max_bytes))
        except RecordError:
            raise
        except (ValueError, TypeError, IndexError, AttributeError, msgpack.UnpackException) as e:
            raise RecordError(f"span entry unreadable: {e!r}") from None
        return views


# The spans one store call writes travel to Redis and rest there as ONE value: their records as a
# msgpack array, zstd-compressed at level -1 (the client pays it). Per value and per field, not per
# byte, is where Redis spends its CPU on spans (Lua strings, AOF lines, stream fields), and spans are
# most of Redis's memory: the prompts of one rollout's calls repeat each other. Level -1 leaves out the
# entropy coding, which was most of the adapter's decompression; with the token ids as byte planes
# (`fulmen.tokens`) a call's batch stays within 3% of level 1's size. Values written at other levels,
# or as zlib, are still read. Why: docs/design/records.md; figures in bench/RESULTS.md.
BATCH_FIELD = "z"
ZSTD_LEVEL = -1
# Decompressing more than this is refused (a corrupt or hostile entry must not exhaust memory).
MAX_BATCH_BYTES = 256 * 1024 * 1024
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame's first bytes; a zlib stream starts with 0x78
_codecs = threading.local()  # zstd contexts are not thread-safe: one pair per thread
_ONLY_BYTES = frozenset({bytes})


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair = getattr(_codecs, "pair", None)
    if pair is None:
        pair = _codecs.pair = (zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor())
    return pair


def pack_span_batch(records: Sequence[bytes]) -> bytes:
    """The stored form of the span records of one call, in order (`BATCH_FIELD`)."""
    return _zstd()[0].compress(msgpack.packb(list(records), use_bin_type=True))


def unpack_span_batch(blob: bytes, max_bytes: int = MAX_BATCH_BYTES) -> list[bytes]:
    """The span records of a `pack_span_batch` value (zstd, or zlib as written before); RecordError
    if it is not one, RecordTooLarge if it would decompress to more than ``max_bytes``."""
    raw = _decompress(blob, max_bytes)
    try:
        records = msgpack.unpackb(raw, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise RecordError(f"span batch is not a msgpack array: {e}") from None
    if type(records) is not list or not _ONLY_BYTES.issuperset(map(type, records)):
        raise RecordError("span batch is not an array of span records")
    return records


def _decompress(blob: bytes, max_bytes: int) -> bytes:
    if blob[:4] == ZSTD_MAGIC:
        try:
            # a frame that declares its size is decompressed whole whatever max_output_size says
            declared = zstandard.frame_content_size(blob)
            if declared > max_bytes:
                raise RecordTooLarge(f"span batch inflates to over {max_bytes:,} bytes")
            return _zstd()[1].decompress(blob, max_output_size=max_bytes)
        except zstandard.ZstdError as e:  # undeclared and over max_bytes reads as an incomplete frame
            raise RecordError(f"span batch is not zstd data within {max_bytes:,} bytes: {e}") from None
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(blob, max_bytes)
    except zlib.error as e:
        raise RecordError(f"span batch is neither zstd nor zlib data: {e}") from None
    if inflate.unconsumed_tail:
        raise RecordTooLarge(f"span batch inflates to over {max_bytes:,} bytes")
    return raw


def entry_records(entry_id: bytes | str, fields: Any) -> list[tuple[int, bytes]]:
    """The span records of one span-stream entry, each with its sequence id, in order.

    The store writes the new spans of one call as one entry under the id ``<last sequence id>-0``;
    the spans of an entry are numbered consecutively up to it. Today's entries hold them in one
    field, `BATCH_FIELD` (`pack_span_batch`). Entries written before that are read the same: fields
    ``m``, ``m1``, ``m2``, … in order (one XADD per call), or ``m`` alone for one span under its own
    sequence id (one entry per span). ``fields`` is a flat ``[name, value, ...]`` list (XREAD's raw
    reply) or a mapping (redis-py's parsed one); fields named otherwise are not span records."""
    before, records = _entry_batch(entry_id, fields)
    return [(before + 1 + i, record) for i, record in enumerate(records)]


def _entry_batch(entry_id: bytes | str, fields: Any) -> tuple[int, list[bytes]]:
    """`entry_records` as (the sequence id before the entry's first span, its records)."""
    last = int(entry_id[:entry_id.index(b"-" if isinstance(entry_id, bytes) else "-")])
    if isinstance(fields, dict):
        batch = fields.get(b"z")
        if batch is not None:
            records = unpack_span_batch(batch)
            return last - len(records), records
        if len(fields) == 1 and b"m" in fields:
            return last - 1, [fields[b"m"]]
        items: Iterable[tuple[Any, Any]] = fields.items()
    else:
        if len(fields) == 2:
            if fields[0] == b"z":  # as the store writes a call's spans
                records = unpack_span_batch(fields[1])
                return last - len(records), records
            if fields[0] == b"m":  # as the store wrote one span
                return last - 1, [fields[1]]
        items = zip(fields[::2], fields[1::2], strict=True)
    records = [value for name, value in items if _is_record_field(name)]
    return last - len(records), records


def _is_record_field(name: bytes | str) -> bool:
    text = name.decode() if isinstance(name, bytes) else name
    return text == "m" or (text[:1] == "m" and text[1:].isdigit())
