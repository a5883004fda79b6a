"""`Record`: the msgpack map form of a frozen dataclass, derived from its fields.

`Record.from_wire` refuses a wrong kind, version, field or type with `RecordError`; `check_wire`
checks values. Off-wire and custom-coded fields, and the type rules: docs/design/records.md.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple, Self

from fulmen import keys
from fulmen.codec import DEFAULT_MAX_RECORD_BYTES, SCHEMA_VERSION, pack, unpack_record
from fulmen.errors import InvalidInput, RecordError

_OFF_WIRE = "fulmen.off_wire"
_CODEC = "fulmen.wire_codec"
_MISSING = object()
_NONE = type(None)


# Field metadata of a field kept off the wire (e.g. an entry id read with the record): `from_wire`
# takes it by keyword, so it needs a default.
OFF_WIRE: Mapping[str, Any] = MappingProxyType({_OFF_WIRE: True})


def wire_codec(encode: Callable[[Any], Any], decode: Callable[[Any], Any]) -> Mapping[str, Any]:
    """Field metadata: the field is written as ``encode(value)`` and read as ``decode(wire_value)``;
    ``decode`` checks the value itself (raising RecordError, TypeError or ValueError)."""
    return MappingProxyType({_CODEC: (encode, decode)})


class _Field(NamedTuple):
    name: str
    required: bool
    accepted: frozenset[type] | None  # exact types allowed on the wire; None: anything
    convert: Callable[[Any], Any] | None  # wire value -> field value, after the type check
    expected: str  # for the error message: the annotation as written


class _Schema(NamedTuple):
    kind: str
    fields: tuple[_Field, ...]
    names: frozenset[str]
    encoders: tuple[tuple[str, Callable[[Any], Any] | None], ...]
    checks: bool  # the class overrides `Record.check_wire`


class Record:
    """Base of the records exchanged as msgpack maps (subclasses are frozen dataclasses)."""

    __slots__ = ()
    KIND: ClassVar[str]
    MAX_BYTES: ClassVar[int] = DEFAULT_MAX_RECORD_BYTES  # the size limit when the caller gives none

    def to_wire(self, max_bytes: int | None = None) -> bytes:
        """The msgpack bytes of this record; RecordTooLarge over ``max_bytes``."""
        schema = _SCHEMAS.get(type(self)) or _schema(type(self))
        record: dict[str, Any] = {"v": SCHEMA_VERSION, "kind": schema.kind}
        for name, encode in schema.encoders:
            value = getattr(self, name)
            record[name] = value if encode is None else encode(value)
        return pack(record, self.MAX_BYTES if max_bytes is None else max_bytes)

    @classmethod
    def from_wire(cls, data: bytes | None, max_bytes: int | None = None, **off_wire: Any) -> Self:
        """Decode bytes written by `to_wire` (``data`` is None when a stream entry has no ``m`` field);
        anything else raises RecordError. ``off_wire`` holds the fields not carried on the wire."""
        schema = _SCHEMAS.get(cls) or _schema(cls)
        kind = schema.kind
        d = unpack_record(data, kind, cls.MAX_BYTES if max_bytes is None else max_bytes)
        values: dict[str, Any] = {}
        for name, required, accepted, convert, expected in schema.fields:
            value = d.get(name, _MISSING)
            if value is _MISSING:
                if required:
                    raise RecordError(f"{kind} record has no {name!r}")
                continue
            if accepted is not None and type(value) not in accepted:
                raise RecordError(
                    f"{kind} record's {name!r} has the wrong type {type(value).__name__}, expected {expected}"
                )
            if convert is not None:
                try:
                    value = convert(value)
                except (RecordError, TypeError, ValueError) as e:  # the message is built off the hot path
                    raise _refused(kind, name, value, expected, e) from None
            values[name] = value
        if len(values) + 2 != len(d):  # "v" and "kind" are there: unpack_record checked them
            unknown = sorted(map(str, set(d) - schema.names - {"v", "kind"}))
            raise RecordError(f"{kind} record has unknown fields {unknown}")
        if off_wire:
            values.update(off_wire)
        record = cls(**values)
        if schema.checks:
            try:
                record.check_wire()
            except (TypeError, ValueError) as e:  # a value of a type the checks did not expect
                raise RecordError(f"{kind} record has unusable values: {type(e).__name__}: {e}") from None
        return record

    def check_wire(self) -> None:
        """Refuse (RecordError) a decoded record whose fields have the right types but not valid
        values; override where a type says too little. The default accepts every record."""


# Value checks for `Record.check_wire`: each raises RecordError naming the record's kind and the field.


def require(record: Record, ok: bool, text: str) -> None:
    """Refuse ``record`` unless ``ok``; ``text`` says what is wrong."""
    if not ok:
        raise RecordError(f"{record.KIND} record: {text}")


def require_nonempty(record: Record, *names: str) -> None:
    """The named str fields hold at least one character (an id of "" names nothing)."""
    for name in names:
        if not getattr(record, name):
            raise RecordError(f"{record.KIND} record's {name!r} is empty")


def require_id(record: Record, name: str) -> None:
    """The named field is a valid store id (`fulmen.keys.check_id`): it goes into Redis keys."""
    try:
        keys.check_id(name, getattr(record, name))
    except InvalidInput as e:
        raise RecordError(f"{record.KIND} record: {e}") from None


def require_finite(record: Record, *names: str, minimum: float | None = None) -> None:
    """The named float fields (None allowed) are finite numbers, at least ``minimum`` if given: a NaN
    or infinite reward or time poisons every sum it enters."""
    for name in names:
        value = getattr(record, name)
        if value is None:
            continue
        if not math.isfinite(value) or (minimum is not None and value < minimum):
            bound = "" if minimum is None else f" >= {minimum}"
            raise RecordError(f"{record.KIND} record's {name!r} is {value!r}, expected a finite number{bound}")


def require_at_least(record: Record, minimum: int, *names: str) -> None:
    """The named int fields (None allowed) are at least ``minimum``."""
    for name in names:
        value = getattr(record, name)
        if value is not None and value < minimum:
            raise RecordError(f"{record.KIND} record's {name!r} is {value!r}, expected >= {minimum}")


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: type[Record]) -> _Schema:
    """Build and cache the schema of a record class (on first use: every annotation is importable then)."""
    if not dataclasses.is_dataclass(cls) or not isinstance(getattr(cls, "KIND", None), str):
        raise TypeError(f"{cls.__name__} must be a dataclass with a KIND")
    hints = typing.get_type_hints(cls)
    fields: list[_Field] = []
    encoders: list[tuple[str, Callable[[Any], Any] | None]] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get(_OFF_WIRE):
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        expected = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        codec = f.metadata.get(_CODEC)
        if codec is not None:
            fields.append(_Field(f.name, required, None, codec[1], expected))
            encoders.append((f.name, codec[0]))
            continue
        accepted, convert, encode = _decoder(hints[f.name], cls.__name__, f.name)
        fields.append(_Field(f.name, required, accepted, convert, expected))
        encoders.append((f.name, encode))
    schema = _Schema(
        cls.KIND,
        tuple(fields),
        frozenset(f.name for f in fields),
        tuple(encoders),
        cls.check_wire is not Record.check_wire,
    )
    _SCHEMAS[cls] = schema
    return schema


_Decoder = tuple[frozenset[type] | None, Callable[[Any], Any] | None, Callable[[Any], Any] | None]


def _decoder(hint: Any, owner: str, name: str) -> _Decoder:
    """(wire types accepted, wire -> field converter, field -> wire encoder) for one annotation."""
    if hint is Any:
        return None, None, None
    origin = typing.get_origin(hint)
    if origin is types.UnionType or origin is typing.Union:
        parts = [_decoder(arg, owner, name) for arg in typing.get_args(hint) if arg is not _NONE]
        if any(accepted is None for accepted, _, _ in parts):
            return None, None, None
        accepted = frozenset().union(*(a for a, _, _ in parts if a is not None))
        converts = [(a, c) for a, c, _ in parts if c is not None]
        if len(converts) > 1:
            raise TypeError(f"{owner}.{name}: a union of more than one converted type is not supported")
        convert = None
        if converts:
            only, conv = converts[0]
            convert = conv if len(parts) == 1 else _when(only, conv)
        if _NONE in typing.get_args(hint):
            accepted |= {_NONE}
            convert = _optional(convert)
        return accepted, convert, None
    base = origin or hint
    if base is float:
        return frozenset({float, int}), float, None
    if base is tuple:
        return frozenset({list, tuple}), tuple, None
    if base in (str, int, bool, bytes, dict, list, memoryview):
        return frozenset({base}), None, None
    if isinstance(base, type) and issubclass(base, enum.StrEnum):
        return frozenset({str}), _enum(base), None
    raise TypeError(f"{owner}.{name}: annotation {hint!r} has no wire form")


def _optional(convert: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    if convert is None:
        return None
    return lambda value: None if value is None else convert(value)


def _when(accepted: frozenset[type], convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: convert(value) if type(value) in accepted else value


class _UnknownMember(ValueError):
    """A string that is no member of the field's StrEnum; its text lists the members."""


def _refused(kind: str, name: str, value: Any, expected: str, e: Exception) -> RecordError:
    """The RecordError for a wire value of field ``name`` that its conversion refused with ``e``."""
    if isinstance(e, _UnknownMember):
        return RecordError(f"{kind} record has unknown {name} {value!r}; allowed: {e}")
    if isinstance(e, RecordError):
        return RecordError(f"{kind} record's {name!r}: {e}")
    return RecordError(f"{kind} record's {name!r} does not fit {expected}: {e}")


def _enum(enum_type: type[enum.StrEnum]) -> Callable[[Any], Any]:
    allowed = ", ".join(member.value for member in enum_type)

    def convert(value: str) -> enum.StrEnum:
        try:
            return enum_type(value)
        except ValueError:
            raise _UnknownMember(allowed) from None

    return convert
