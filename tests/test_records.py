"""Records built on `fulmen.records.base.Record`: bytes written by the hand-written encoders before
still decode to the same record and are written again byte for byte; every malformed record is
refused with RecordError, never TypeError, KeyError or ValueError."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import msgpack
import pytest

from fulmen.errors import RecordError, RecordTooLarge, SchemaVersionError
from fulmen.records import (
    ControlAction,
    ControlMessage,
    DeadLetter,
    ProxyEndpoint,
    QueueEntry,
    Record,
    ResourcesUpdate,
    Sample,
    SampleSkip,
    ServiceBeat,
    TrainStep,
    WeightsChunk,
    Worker,
    pack_sample,
)
from fulmen.records.base import OFF_WIRE
from fulmen.telemetry.steps import summarize

# Each record's bytes as the hand-written `to_wire` of commit ce35140 wrote them, and the record.
OLD_WIRE: list[tuple[bytes, Record]] = [
    (b"\x83\xa1v\x01\xa4kind\xa5queue\xaarollout_id\xa2r1", QueueEntry("r1")),
    (
        b"\x87\xa1v\x01\xa4kind\xabdead_letter\xa6source\xa8fx:queue\xa8entry_id\xa31-0\xa6reason\xbanot a "
        b"valid msgpack record\xa7payload\x81\xa1m\xc4\x01\xc1\xa4time\xcb@)\x00\x00\x00\x00\x00\x00",
        DeadLetter("fx:queue", "1-0", "not a valid msgpack record", {"m": b"\xc1"}, 12.5),
    ),
    (
        b"\x87\xa1v\x01\xa4kind\xa9resources\xacresources_id\xa5res-1\xa7version\x03\xa9resources\x81\xa6prompt"
        b"\xa6Hi {x}\xabcreate_time\xcb@Y\x00\x00\x00\x00\x00\x00\xa8metadata\x81\xa2by\xa3apo",
        ResourcesUpdate("res-1", 3, {"prompt": "Hi {x}"}, 100.0, {"by": "apo"}),
    ),
    (
        b"\x86\xa1v\x01\xa4kind\xa6worker\xa9worker_id\xa2w1\xa6status\xa4busy\xb3last_heartbeat_time\xcb@I\x00"
        b"\x00\x00\x00\x00\x00\xa8metadata\x81\xa4host\xa1h",
        Worker("w1", "busy", 50.0, {"host": "h"}),
    ),
    (
        b"\x88\xa1v\x01\xa4kind\xa5proxy\xa8proxy_id\xa2p1\xa8base_url\xb4http://10.0.0.5:8000\xa5model\xa4tiny"
        b"\xadmodel_version\xa2v3\xb3last_heartbeat_time\xcb@I\x80\x00\x00\x00\x00\x00\xa8metadata\x81\xa5state"
        b"\xa7serving",
        ProxyEndpoint("p1", "http://10.0.0.5:8000", "tiny", "v3", 51.0, {"state": "serving"}),
    ),
    (
        b"\x88\xa1v\x01\xa4kind\xadweights_chunk\xadmodel_version\xa2v3\xa5index\x00\xa5total\x02\xa6sha256\xd9@"
        + b"ab" * 32
        + b"\xa4size\n\xa4data\xc4\x02\x00\x01",
        WeightsChunk("v3", 0, 2, "ab" * 32, 10, b"\x00\x01"),
    ),
    (
        b"\xde\x00\x14\xa1v\x01\xa4kind\xa6sample\xa9sample_id\xa5a1/t0\xa5shape\xa7triplet\xaarollout_id\xa2r1"
        b"\xaaattempt_id\xa2a1\xa9group_key\xa6task-1\xaaturn_index\x00\xb0prompt_token_ids\xc4\x08\x01\x00\x00"
        b"\x00\x02\x00\x00\x00\xb2response_token_ids\xc4\x04\x03\x00\x00\x00\xb1response_logprobs\xc4\x04\x00\x00"
        b"\x00\xbf\xadresponse_mask\xc4\x01\x01\xa6reward\xcb?\xf0\x00\x00\x00\x00\x00\x00\xacfinal_reward\xcb?"
        b"\xf0\x00\x00\x00\x00\x00\x00\xadmodel_version\xa2v3\xa4mode\xa5train\xaagroup_size\x04\xa9num_turns\x01"
        b'\xacrequest_json\xb0{"messages": []}\xadresponse_json\xb5{"role": "assistant"}',
        Sample(
            "a1/t0", "triplet", "r1", "a1", "task-1", 0, [1, 2], [3], [-0.5], [1], 1.0, 1.0, "v3", "train", 4, 1,
            '{"messages": []}', '{"role": "assistant"}',
        ),
    ),
    (
        b"\x89\xa1v\x01\xa4kind\xabsample_skip\xaarollout_id\xa2r2\xaaattempt_id\xc0\xa9group_key\xa6task-1"
        b"\xa6status\xa6failed\xa6reason\xa6failed\xa4mode\xa5train\xaagroup_size\x04",
        SampleSkip("r2", None, "task-1", "failed", "failed", "train", 4),
    ),
    (
        b"\x89\xa1v\x01\xa4kind\xa7service\xa7service\xa6runner\xa8instance\xaarunner-h-1\xa4host\xa1h\xa3pid"
        b"\x01\xa4port\xc0\xa7started\xcb@$\x00\x00\x00\x00\x00\x00\xa4time\xcb@&\x00\x00\x00\x00\x00\x00",
        ServiceBeat("runner", "runner-h-1", "h", 1, None, 10.0, 11.0),
    ),
    (
        b"\x88\xa1v\x01\xa4kind\xaatrain_step\xa4step\x03\xadmodel_version\xa2v3\xabreward_mean\xcb?\xe0\x00\x00"
        b"\x00\x00\x00\x00\xa4loss\xcb?\xb9\x99\x99\x99\x99\x99\x9a\xa7samples@\xa4time\xcb@(\x00\x00\x00\x00\x00"
        b"\x00",
        TrainStep(3, "v3", 0.5, 0.1, 64, 12.0),
    ),
    (
        b"\x87\xa1v\x01\xa4kind\xa7control\xa6action\xa5drain\xaacontrol_id\xa2c1\xa9proxy_ids\x91\xa2p1"
        b"\xa9timeout_s\xcb@\x14\x00\x00\x00\x00\x00\x00\xa4time\xcb@^\xc0\x00\x00\x00\x00\x00",
        ControlMessage(ControlAction.DRAIN, "c1", ("p1",), 5.0, 123.0),
    ),
]
OLD_IDS = [type(record).__name__ for _, record in OLD_WIRE]


@pytest.mark.parametrize(("data", "record"), OLD_WIRE, ids=OLD_IDS)
def test_old_bytes_decode_to_the_same_record(data: bytes, record: Record) -> None:
    """A record written by the hand-written encoder decodes with the base to the same record."""
    assert type(record).from_wire(data) == record


# TrainStep gained its ``metrics`` map after ce35140, Sample its ``retokenized`` flag (distillation): their
# old bytes still decode (above), new ones carry the new field.
SAME_WIRE = [(data, record) for data, record in OLD_WIRE if not isinstance(record, TrainStep | Sample)]


@pytest.mark.parametrize(("data", "record"), SAME_WIRE, ids=[type(r).__name__ for _, r in SAME_WIRE])
def test_wire_bytes_are_unchanged(data: bytes, record: Record) -> None:
    """The base writes the same bytes the hand-written encoder wrote."""
    assert record.to_wire() == data


def test_a_train_step_carries_every_numeric_metric_of_its_step() -> None:
    """summarize keeps each namespaced number (not flags, lists or bookkeeping) and it survives the wire."""
    metrics = {"loss/total": 0.25, "rollout/reward_mean": 0.5, "perf/samples": 64, "comm/ratio": 99,
               "perf/flag": True, "sample_ids": ["a"], "model_version": "v3", "step": 3, "time": 1.0}
    step = summarize(3, metrics, 12.0)
    assert step.metrics == {"loss/total": 0.25, "rollout/reward_mean": 0.5, "perf/samples": 64.0, "comm/ratio": 99.0}
    assert TrainStep.from_wire(step.to_wire()) == step


def test_pack_sample_writes_the_bytes_of_sample_to_wire() -> None:
    """The adapter's object-free `pack_sample` and `Sample.to_wire` agree byte for byte."""
    _, sample = next((d, r) for d, r in OLD_WIRE if isinstance(r, Sample))
    for flagged in (sample, dataclasses.replace(sample, retokenized=True)):
        fields = {f.name: getattr(flagged, f.name) for f in dataclasses.fields(flagged)}
        assert pack_sample(fields) == flagged.to_wire()
        assert Sample.from_wire(flagged.to_wire()) == flagged


# --- refusals, for every record kind ----------------------------------------------------------------


def _wire_fields(cls: type[Record]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("fulmen.off_wire")]


def _required(cls: type[Record]) -> list[str]:
    return [
        f.name
        for f in _wire_fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


# candidates for a value of the wrong type, each with the word its annotation would contain
_WRONG = [(1.5, "float"), ("x", "str"), (b"x", "bytes"), ([1], "list"), ({"a": 1}, "dict"), (True, "bool")]


def _wrong_value(annotation: str) -> object:
    return next(value for value, word in _WRONG if word not in annotation)


def _cases() -> list[Any]:
    cases = []
    for data, record in OLD_WIRE:
        cls = type(record)
        name = cls.__name__
        good = msgpack.unpackb(data, raw=False)
        cases.append(pytest.param(cls, None, RecordError, "entry has no 'm' field", id=f"{name}-none"))
        cases.append(pytest.param(cls, {**good, "v": 2}, SchemaVersionError, "schema version 2", id=f"{name}-v2"))
        cases.append(pytest.param(cls, {**good, "kind": "other"}, RecordError, "got kind 'other'", id=f"{name}-kind"))
        cases.append(pytest.param(cls, [1, 2], RecordError, "must be a map", id=f"{name}-not-a-map"))
        cases.append(pytest.param(cls, b"\xc1", RecordError, "not a valid msgpack", id=f"{name}-garbage"))
        cases.append(
            pytest.param(cls, {**good, "bogus": 1}, RecordError, r"unknown fields \['bogus'\]", id=f"{name}-unknown")
        )
        for required in _required(cls):
            missing = {k: v for k, v in good.items() if k != required}
            cases.append(pytest.param(cls, missing, RecordError, f"has no '{required}'", id=f"{name}-no-{required}"))
        for f in _wire_fields(cls):
            wrong = {**good, f.name: _wrong_value(f.type)}
            cases.append(pytest.param(cls, wrong, RecordError, f"'{f.name}'", id=f"{name}-type-{f.name}"))
    return cases


@pytest.mark.parametrize(("cls", "value", "error", "match"), _cases())
def test_malformed_records_are_refused(cls: type[Record], value: Any, error: type, match: str) -> None:
    """A missing record, another version or kind, a missing or unknown field and a wrong type are
    refused with RecordError naming the problem."""
    data = value if value is None or isinstance(value, bytes) else msgpack.packb(value, use_bin_type=True)
    with pytest.raises(error, match=match):
        cls.from_wire(data)


def test_bool_is_not_an_int_and_ints_are_floats() -> None:
    """A bool in an int field is refused; an int in a float field reads as a float."""
    with pytest.raises(RecordError, match="'step' has the wrong type bool, expected int"):
        good = msgpack.unpackb(TrainStep(3, "v3", 0.5, 0.1, 64, 12.0).to_wire())
        TrainStep.from_wire(msgpack.packb({**good, "step": True}))
    step = TrainStep.from_wire(TrainStep(3, "v3", 1, None, None, 12).to_wire())
    assert step == TrainStep(3, "v3", 1.0, None, None, 12.0)
    assert type(step.reward_mean) is float and type(step.time) is float


def test_unknown_enum_value_is_refused_by_name() -> None:
    """A StrEnum field with a value outside the enum is refused, naming the field and the members."""
    data = ControlMessage(ControlAction.PAUSE).to_wire().replace(b"\xa5pause", b"\xa5stall")
    with pytest.raises(RecordError, match="control record has unknown action 'stall'; allowed: pause, drain"):
        ControlMessage.from_wire(data)


def test_off_wire_field_is_passed_by_keyword_and_never_written() -> None:
    """The dead-letter id is not on the wire: from_wire takes it by keyword, and on the wire it is unknown."""
    letter = DeadLetter("fx:queue", "1-0", "why", {}, 1.0, dead_letter_id="9-0")
    data = letter.to_wire()
    assert b"dead_letter_id" not in data
    assert DeadLetter.from_wire(data, dead_letter_id="9-0") == letter
    assert DeadLetter.from_wire(data).dead_letter_id == ""
    smuggled = msgpack.packb({**msgpack.unpackb(data), "dead_letter_id": "9-0"}, use_bin_type=True)
    with pytest.raises(RecordError, match="unknown fields"):
        DeadLetter.from_wire(smuggled)


def test_size_limit_applies_both_ways() -> None:
    """to_wire and from_wire refuse a record over ``max_bytes`` (or the class's MAX_BYTES)."""
    update = ResourcesUpdate("r", 1, {"x": "y" * 100}, 1.0)
    with pytest.raises(RecordTooLarge):
        update.to_wire(max_bytes=50)
    with pytest.raises(RecordTooLarge):
        ResourcesUpdate.from_wire(update.to_wire(), 50)


# --- the base's type handling, on a record made for it ----------------------------------------------


class _Colour(StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, slots=True)
class _Probe(Record):
    KIND: ClassVar[str] = "probe"
    MAX_BYTES: ClassVar[int] = 1000

    names: tuple[str, ...]
    colour: _Colour | None
    blob: bytes | memoryview
    anything: Any
    flag: bool = False
    entry_id: str = field(default="", metadata=OFF_WIRE)

    def check_wire(self) -> None:
        if "" in self.names:
            raise RecordError("probe record has an empty name")


def test_base_converts_tuples_and_enums_and_runs_check_wire() -> None:
    """Tuples come back from msgpack arrays, enums from their values, and `check_wire` runs after decoding."""
    probe = _Probe(("a", "b"), _Colour.BLUE, b"\x00", {"k": [1]}, True)
    back = _Probe.from_wire(probe.to_wire(), entry_id="1-1")
    assert back == dataclasses.replace(probe, entry_id="1-1")
    assert type(back.names) is tuple and back.colour is _Colour.BLUE
    assert _Probe.from_wire(_Probe((), None, b"", None).to_wire()).colour is None
    with pytest.raises(RecordError, match="empty name"):
        _Probe.from_wire(_Probe(("",), None, b"", None).to_wire())
    with pytest.raises(RecordError, match="unknown colour 'green'"):
        _Probe.from_wire(msgpack.packb({"v": 1, "kind": "probe", "names": [], "colour": "green", "blob": b"", "anything": 1}))
    with pytest.raises(RecordTooLarge):
        _Probe(("x" * 2000,), None, b"", None).to_wire()


def test_unsupported_annotation_fails_on_first_use() -> None:
    """A field type the base has no wire form for is a TypeError for the class's author, not a RecordError."""

    @dataclass(frozen=True, slots=True)
    class Odd(Record):
        KIND: ClassVar[str] = "odd"
        when: complex

    with pytest.raises(TypeError, match="has no wire form"):
        Odd(1j).to_wire()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reward": float("nan")}, "'reward' is nan, expected a finite number"),
        ({"final_reward": float("inf")}, "'final_reward' is inf, expected a finite number"),
        ({"response_token_ids": [], "response_logprobs": [], "response_mask": []}, "needs prompt and response token ids"),
        ({"prompt_token_ids": [1, -2]}, "token ids must not be negative"),
        ({"group_size": 0}, "'group_size' is 0, expected >= 1"),
    ],
)
def test_a_sample_the_trainer_cannot_learn_from_is_refused(change: dict, message: str) -> None:
    """Types alone let these through; check_wire refuses them, so the trainers' group dead-letters them."""
    _, sample = next((d, r) for d, r in OLD_WIRE if isinstance(r, Sample))
    with pytest.raises(RecordError, match=message):
        Sample.from_wire(dataclasses.replace(sample, **change).to_wire())


def test_a_sample_whose_mask_is_a_map_is_refused_with_a_reason() -> None:
    """Found by the stream fuzz: a mask sent as a map decoded into its keys and crashed the value
    checks with a TypeError; it is a RecordError now, so the consumer dead-letters it."""
    import msgpack

    from fulmen.errors import RecordError
    from fulmen.records import Sample

    good = Sample("r.1/t0", "triplet", "r", "r.1", "g", 0, [1, 2], [3, 4], [-0.5, -0.25], [1, 1], 1.0, 1.0, "base",
                  mode="train", group_size=2)
    record = msgpack.unpackb(good.to_wire(), raw=False)
    record["response_mask"] = {"": 0, "0": 0}
    with pytest.raises(RecordError, match="mask"):
        Sample.from_wire(msgpack.packb(record))
