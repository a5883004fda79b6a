"""Spans: what the runner and the proxy record of an attempt, and the adapter's cheap view of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from fulmen.codec import (
    DEFAULT_MAX_RECORD_BYTES,
    SCHEMA_VERSION,
    check_version,
    pack_record,
    unpack,
    unpack_record,
)
from fulmen.errors import RecordError


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
        fields: dict[str, Any] = {
            "rollout_id": self.rollout_id,
            "attempt_id": self.attempt_id,
            "span_id": self.span_id,
            "name": self.name,
            "trace_id": self.trace_id,
            "parent_id": self.parent_id,
            "start_time": self.start_time,
            "end_time": self.end_time,
            "attributes": self.attributes,
        }
        # The rest only when not the default: most spans have no status, events, links or resource,
        # and each field left out is two objects fewer for every reader to decode (the adapter reads
        # tens of thousands of spans a second). `from_wire` fills in the defaults, so records with and
        # without them are the same schema version.
        if self.status_code != "UNSET":
            fields["status_code"] = self.status_code
        if self.status_message:
            fields["status_message"] = self.status_message
        if self.events:
            fields["events"] = self.events
        if self.links:
            fields["links"] = self.links
        if self.resource:
            fields["resource"] = self.resource
        return pack_record("span", fields, max_bytes)

    @classmethod
    def from_wire(cls, data: bytes, sequence_id: int, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Span:
        d = unpack_record(data, "span", max_bytes)
        del d["v"], d["kind"]
        return cls(**d, sequence_id=sequence_id)


class SpanView:
    """The parts of a stored span record that walking an attempt's span tree needs (the adapter):
    ids, name, times, attributes. Read-only by convention; same attribute names as `Span`.

    The adapter reads 8 spans per rollout at thousands of rollouts a second: building a frozen
    15-field `Span` cost more than decoding the record, so this one is a plain slotted object, and
    `from_wire` decodes in one msgpack call (tuples for arrays, which are cheaper than lists) and
    checks only what the store does not guarantee: the schema version, the kind, and the types of the
    fields used here."""

    __slots__ = ("attempt_id", "attributes", "end_time", "name", "parent_id", "rollout_id", "sequence_id",
                 "span_id", "start_time")

    def __init__(self, sequence_id: int, rollout_id: str, attempt_id: str, span_id: str, parent_id: str | None,
                 name: str, start_time: float | None, end_time: float | None, attributes: dict[str, Any]) -> None:
        self.sequence_id = sequence_id
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.name = name
        self.start_time = start_time
        self.end_time = end_time
        self.attributes = attributes

    def __repr__(self) -> str:
        return f"SpanView({self.sequence_id}, {self.span_id!r}, {self.name!r})"

    @classmethod
    def from_wire(cls, data: bytes, sequence_id: int, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> SpanView:
        """Decode a span record as `Span.from_wire` would (RecordError for anything it would refuse,
        SchemaVersionError for another version), keeping only the fields above."""
        if len(data) > max_bytes:
            unpack(data, max_bytes)  # raises RecordTooLarge with the usual message
        try:
            d = msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData) as e:
            raise RecordError(f"not a valid msgpack record: {e}") from e
        if type(d) is not dict:
            raise RecordError(f"a span record must be a map, got {type(d).__name__}")
        if d.get("v") != SCHEMA_VERSION:
            check_version(d.get("v"), "span")
        if d.get("kind") != "span":
            raise RecordError(f"expected a span record, got kind {d.get('kind')!r}")
        try:
            view = cls(sequence_id, d["rollout_id"], d["attempt_id"], d["span_id"], d.get("parent_id"), d["name"],
                       d.get("start_time"), d.get("end_time"), d.get("attributes") or {})
        except KeyError as e:
            raise RecordError(f"span record has no {e.args[0]!r}") from None
        if type(view.span_id) is not str or type(view.name) is not str or type(view.attributes) is not dict:
            raise RecordError("span record has a span_id, name or attributes of the wrong type")
        return view
