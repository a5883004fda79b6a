"""The adapter's cheap span decoding (SpanView) and sample encoding (pack_sample) agree with the records."""

from __future__ import annotations

import pytest

from fulmen import codec
from fulmen.errors import RecordError, SchemaVersionError
from fulmen.records import Sample, Span, SpanView, pack_sample
from fulmen.store.samples import _span_views
from fulmen.telemetry import semconv

SPAN = Span("r1", "r1.1", "s1", "chat tiny", "t" * 32, "root", 1.0, 2.0,
            attributes={semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.PROMPT_TOKEN_IDS: b"\x01\x00\x00\x00"})


def test_span_view_reads_what_span_to_wire_writes() -> None:
    """Every field the tree walk needs comes through, with the store's sequence id."""
    view = SpanView.from_wire(SPAN.to_wire(), 7)
    assert (view.sequence_id, view.rollout_id, view.attempt_id, view.span_id, view.parent_id, view.name) == (
        7, "r1", "r1.1", "s1", "root", "chat tiny")
    assert (view.start_time, view.end_time, view.attributes) == (1.0, 2.0, SPAN.attributes)


def test_span_records_are_positional_leave_defaults_out_and_read_back_whole() -> None:
    """A span with default trace id, status, events, links and resource is stored as the 10-item array
    without them and reads back equal; one with every field set reads back whole."""
    data = SPAN.to_wire()
    assert codec.unpack(data) == [1, "span", "r1", "r1.1", "s1", "root", "chat tiny", 1.0, 2.0, SPAN.attributes,
                                  "t" * 32]
    bare = Span("r1", "r1.1", "s0", "n")
    assert codec.unpack(bare.to_wire()) == [1, "span", "r1", "r1.1", "s0", None, "n", None, None, {}]
    assert Span.from_wire(data, 0) == SPAN
    full = Span("r1", "r1.1", "s2", "tool", status_code="ERROR", status_message="boom", events=[{"name": "e"}],
                links=[{"trace_id": "x"}], resource={"service.name": "runner"})
    assert Span.from_wire(full.to_wire(), 0) == full
    assert Span.from_wire(Span("r1", "r1.1", "s4", "n", links=[{"a": 1}]).to_wire(), 0).links == [{"a": 1}]
    one, two = Span.from_wire(bare.to_wire(), 1), Span.from_wire(bare.to_wire(), 2)
    one.events.append({"name": "mine"})
    assert two.events == [] and Span.from_wire(bare.to_wire(), 3).events == []  # defaults are not shared


@pytest.mark.parametrize(("data", "error"), [
    (b"\xc1", RecordError),
    (b"\x93not a span", RecordError),
    (codec.pack({"v": 1, "kind": "span", "rollout_id": "r1", "attempt_id": "a", "span_id": "s", "name": "n"}),
     RecordError),  # a map: span records are positional arrays
    (codec.pack_record("queue", {"rollout_id": "r1"}), RecordError),
    (codec.pack_record("span", {"rollout_id": "r1", "attempt_id": "a", "name": "n"}), RecordError),  # no span_id
    (codec.pack_record("span", {"rollout_id": "r1", "attempt_id": "a", "span_id": "s", "name": "n",
                                "attributes": [1]}), RecordError),
    (codec.pack_record("span", {"rollout_id": "r1", "attempt_id": "a", "span_id": "s", "name": "n", "x": 1}),
     RecordError),  # a field no version had
    (codec.pack([99, "span", "r1", "a", "s", None, "n", None, None, {}]), SchemaVersionError),
    (codec.pack([1, "queue", "r1", "a", "s", None, "n", None, None, {}]), RecordError),
    (codec.pack([1, "span", "r1", "a", "s", None, "n", None, None]), RecordError),  # too short
    (codec.pack([1, "span", "r1", "a", "s", None, "n", None, None, {}, *[""] * 7]), RecordError),  # too long
    (codec.pack([1, "span", "r1", "a", 5, None, "n", None, None, {}]), RecordError),  # span id a number
    (codec.pack([1, "span", "r1", "a", "s", {"x": 1}, "n", None, None, {}]), RecordError),  # parent a map
    (codec.pack([1, "span", "r1", "a", "s", None, "n", "soon", None, {}]), RecordError),  # time a string
    (codec.pack([1, "span", "r1", "a", "s", None, "n", None, None, [1]]), RecordError),  # attributes a list
    (codec.pack("span"), RecordError),
])
def test_span_view_refuses_what_span_from_wire_refuses(data: bytes, error: type[Exception]) -> None:
    """Garbage, another schema version, another kind, a missing, extra or mistyped field: refused by both
    decoders with the same error type, never misread (a mistyped time or parent would break the tree walk)."""
    with pytest.raises(error):
        SpanView.from_wire(data, 1)
    with pytest.raises(error):
        Span.from_wire(data, 1)


def test_span_entries_from_xread_become_views_or_the_error() -> None:
    """Entry ids give the sequence ids; an unreadable entry makes the whole rollout's result the error."""
    other = Span("r1", "r1.1", "s9", "n").to_wire()
    entries = [[b"1-0", [b"m", SPAN.to_wire()]], [b"2-0", [b"x", b"1", b"m", SPAN.to_wire()]], [b"3-0", [b"x", b"1"]],
               [b"12-0", [b"m", other]]]
    views = _span_views(entries, 1 << 20)
    assert isinstance(views, list) and [v.sequence_id for v in views] == [1, 2, 12]
    assert views[0] == SpanView.from_wire(SPAN.to_wire(), 1) and views[2] == SpanView.from_wire(other, 12)
    for bad, message in [(b"\xc1", "not a valid msgpack record"), (codec.pack([1, "span", "r", "a", "s", None, "n",
                         "soon", None, {}]), "wrong type"), (SPAN.to_wire(), "over the")]:
        error = _span_views([[b"1-0", [b"m", SPAN.to_wire()]], [b"2-0", [b"m", bad]]], 100 if message == "over the" else 1 << 20)
        assert isinstance(error, RecordError) and message in str(error), error
    assert isinstance(_span_views([[b"x", [b"m", SPAN.to_wire()]]], 1 << 20), RecordError)  # no sequence id


def test_pack_sample_writes_the_bytes_of_sample_to_wire() -> None:
    """The adapter's direct encoding and `Sample.to_wire` give identical records."""
    fields = dict(sample_id="a/t0", shape="triplet", rollout_id="r", attempt_id="a", group_key="g", turn_index=0,
                  prompt_token_ids=[1, 2], response_token_ids=[3], response_logprobs=[-0.5], response_mask=[1],
                  reward=1.0, final_reward=1.0, model_version="v1", mode="train", group_size=4, num_turns=1,
                  request_json="{}", response_json="null", retokenized=False)
    sample = Sample(**fields)  # type: ignore[arg-type]
    assert pack_sample(dict(fields)) == sample.to_wire()
    assert Sample.from_wire(pack_sample(dict(fields))) == sample

