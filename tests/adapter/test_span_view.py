"""The adapter's cheap span decoding (SpanView) and sample encoding (pack_sample) agree with the records."""

from __future__ import annotations

import pytest

from fulmen import codec, semconv
from fulmen.errors import RecordError, SchemaVersionError
from fulmen.records import Sample, Span, SpanView, pack_sample
from fulmen.store.samples import _span_views

SPAN = Span("r1", "r1.1", "s1", "chat tiny", "t" * 32, "root", 1.0, 2.0,
            attributes={semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.PROMPT_TOKEN_IDS: b"\x01\x00\x00\x00"})


def test_span_view_reads_what_span_to_wire_writes() -> None:
    """Every field the tree walk needs comes through, with the store's sequence id."""
    view = SpanView.from_wire(SPAN.to_wire(), 7)
    assert (view.sequence_id, view.rollout_id, view.attempt_id, view.span_id, view.parent_id, view.name) == (
        7, "r1", "r1.1", "s1", "root", "chat tiny")
    assert (view.start_time, view.end_time, view.attributes) == (1.0, 2.0, SPAN.attributes)


def test_span_records_leave_defaults_out_and_read_back_whole() -> None:
    """A span with default status, events, links and resource is stored without them and reads back equal;
    a record written with every field (older writers) still reads."""
    data = SPAN.to_wire()
    assert not {"status_code", "status_message", "events", "links", "resource"} & set(codec.unpack(data))
    assert Span.from_wire(data, 0) == SPAN
    full = Span("r1", "r1.1", "s2", "tool", status_code="ERROR", status_message="boom", events=[{"name": "e"}],
                links=[{"trace_id": "x"}], resource={"service.name": "runner"})
    assert Span.from_wire(full.to_wire(), 0) == full
    old_style = codec.pack_record("span", {
        "rollout_id": "r1", "attempt_id": "r1.1", "span_id": "s3", "name": "n", "trace_id": "", "parent_id": None,
        "start_time": None, "end_time": None, "status_code": "UNSET", "status_message": "", "attributes": {},
        "events": [], "links": [], "resource": {}})
    assert Span.from_wire(old_style, 3) == Span("r1", "r1.1", "s3", "n", sequence_id=3)
    assert SpanView.from_wire(old_style, 3).span_id == "s3"


@pytest.mark.parametrize(("data", "error"), [
    (b"\xc1", RecordError),
    (b"\x93not a span", RecordError),
    (codec.pack({"v": 99, "kind": "span"}), SchemaVersionError),
    (codec.pack_record("queue", {"rollout_id": "r1"}), RecordError),
    (codec.pack_record("span", {"rollout_id": "r1", "attempt_id": "a", "name": "n"}), RecordError),  # no span_id
    (codec.pack_record("span", {"rollout_id": "r1", "attempt_id": "a", "span_id": "s", "name": "n",
                                "attributes": [1]}), RecordError),
])
def test_span_view_refuses_what_span_from_wire_refuses(data: bytes, error: type[Exception]) -> None:
    """Garbage, another schema version, another kind, a missing or mistyped field: refused, never misread."""
    with pytest.raises(error):
        SpanView.from_wire(data, 1)


def test_span_entries_from_xread_become_views_or_the_error() -> None:
    """Entry ids give the sequence ids; an unreadable entry makes the whole rollout's result the error."""
    entries = [[b"1-0", [b"m", SPAN.to_wire()]], [b"2-0", [b"x", b"1", b"m", SPAN.to_wire()]], [b"3-0", [b"x", b"1"]]]
    views = _span_views(entries, 1 << 20)
    assert isinstance(views, list) and [v.sequence_id for v in views] == [1, 2]
    assert isinstance(_span_views([[b"1-0", [b"m", b"\xc1"]]], 1 << 20), RecordError)


def test_pack_sample_writes_the_bytes_of_sample_to_wire() -> None:
    """The adapter's direct encoding and `Sample.to_wire` give identical records."""
    fields = dict(sample_id="a/t0", shape="triplet", rollout_id="r", attempt_id="a", group_key="g", turn_index=0,
                  prompt_token_ids=[1, 2], response_token_ids=[3], response_logprobs=[-0.5], response_mask=[1],
                  reward=1.0, final_reward=1.0, model_version="v1", mode="train", group_size=4, num_turns=1,
                  request_json="{}", response_json="null")
    sample = Sample(**fields)  # type: ignore[arg-type]
    assert pack_sample(dict(fields)) == sample.to_wire()
    assert Sample.from_wire(pack_sample(dict(fields))) == sample
