"""The proxy copies a request's x-fulmen-purpose header into its call's span (a judge's call is
recorded, marked), and a call without it gets no such attribute."""

from __future__ import annotations

from fulmen.telemetry import semconv
from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.recording import MAX_PURPOSE_BYTES, Exchange, build_spans

CALL = Call("chat", {"messages": []}, "m", False, 4, 1.0, 1.0, None, [], rollout_id="r", attempt_id="a")


def _attributes(purpose: bytes | None) -> dict[str, object]:
    exchange = Exchange("torch", b"{}", "0" * 31 + "1", None, 1.0, 2.0, purpose=purpose)
    (span,) = build_spans(CALL, Result(text="4"), span_id="s", exchange=exchange)
    return span.attributes


def test_the_purpose_header_is_the_spans_call_purpose() -> None:
    """As sent, decoded; a value longer than the cap is cut; no header, no attribute."""
    assert _attributes(semconv.PURPOSE_JUDGE.encode())[semconv.CALL_PURPOSE] == semconv.PURPOSE_JUDGE
    assert _attributes(b"x" * 200)[semconv.CALL_PURPOSE] == "x" * MAX_PURPOSE_BYTES
    assert semconv.CALL_PURPOSE not in _attributes(None)
    assert semconv.CALL_PURPOSE not in _attributes(b"")
