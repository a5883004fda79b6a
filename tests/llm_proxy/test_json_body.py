"""The proxy's JSON reader: orjson where it can, the standard library where orjson refuses, so a
body reads the same as with `json.loads` and a bad one fails as it did."""

from __future__ import annotations

import json
import math

import pytest

from fulmen_llm_proxy.api import json_body

ACCEPTED = [
    b'{"model": "m", "messages": [{"role": "user", "content": "h\\u00e9llo"}], "temperature": 0.7}',
    b'{"a": 1, "a": 2, "b": [1.5e-7, -0.0, 18446744073709551615]}',
    b'"\\ud800 a lone surrogate"',  # orjson refuses it
    b'\xef\xbb\xbf{"bom": true}',  # orjson refuses it
    '{"utf16": 1}'.encode("utf-16"),  # orjson refuses it
]


@pytest.mark.parametrize("raw", ACCEPTED)
def test_a_body_reads_as_the_standard_library_reads_it(raw: bytes) -> None:
    assert json_body.loads(raw) == json.loads(raw)


def test_nan_and_infinity_still_read_as_floats() -> None:
    body = json_body.loads(b'{"x": NaN, "y": -Infinity}')  # orjson refuses them
    assert math.isnan(body["x"]) and body["y"] == -math.inf


@pytest.mark.parametrize("raw", [b'{"a": ', b"\xff", b"[" * 100_000])
def test_a_bad_body_fails_as_with_the_standard_library(raw: bytes) -> None:
    with pytest.raises(Exception) as ours:
        json_body.loads(raw)
    with pytest.raises(Exception) as theirs:
        json.loads(raw)
    assert type(ours.value) is type(theirs.value)


@pytest.mark.parametrize("raw", [*ACCEPTED[:3], b'{"lp": [-Infinity, NaN, Infinity, -0.5]}'])
def test_what_is_read_is_written_back_as_it_was_read(raw: bytes) -> None:
    written = json_body.dumps(json_body.loads(raw))
    again, before = json.loads(written), json.loads(raw)
    assert json.dumps(again) == json.dumps(before)  # NaN-aware: json.dumps writes NaN as NaN


def test_a_nan_read_is_written_as_nan_never_as_null() -> None:
    """orjson writes a float NaN as null; a NaN read from an upstream's answer must reach the agent as
    the upstream wrote it."""
    written = json_body.dumps(json_body.loads(b'{"logprob": -Infinity, "x": NaN}'))
    assert written == b'{"logprob":-Infinity,"x":NaN}'


def test_what_orjson_cannot_write_is_written_by_the_standard_library() -> None:
    assert json_body.dumps({"i": 2**70}) == b'{"i":1180591620717411303424}'
    assert json_body.dumps({"s": "\ud800"}) == b'{"s":"\\ud800"}'  # escaped: valid UTF-8
    assert json_body.dumps({"t": "h\u00e9"}) == '{"t":"h\u00e9"}'.encode()
