"""The adapter never samples an LLM call made for another purpose than the policy's (a judge's), and
counts it; a call marked "policy", or unmarked, is sampled as always."""

from __future__ import annotations

import pytest

from fulmen.records import Span
from fulmen.telemetry import semconv
from fulmen_adapter.triplets import (
    SKIPPED_JUDGE_CALLS,
    SKIPPED_OTHER_CALLS,
    AdapterConfig,
    AttemptInfo,
    Skip,
    sample_fields,
)

INFO = AttemptInfo("r1", "r1.1", "g", reward=1.0)


def call(span_id: str, start: float, purpose: str | None = None) -> Span:
    attributes = {semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.PROMPT_TOKEN_IDS: [1, 2],
                  semconv.RESPONSE_TOKEN_IDS: [3], semconv.RESPONSE_LOGPROBS: [-0.5]}
    if purpose is not None:
        attributes[semconv.CALL_PURPOSE] = purpose
    return Span("r1", "r1.1", span_id, "chat m", start_time=start, end_time=start + 0.5, attributes=attributes,
                sequence_id=int(start))


def test_a_judges_call_is_counted_never_sampled() -> None:
    """Of the policy's call, a judge's and a summariser's, only the policy's is a sample; the others count."""
    stats: dict[str, int] = {}
    spans = [call("p", 1.0), call("j", 2.0, semconv.PURPOSE_JUDGE), call("s", 3.0, "summary"),
             call("q", 4.0, semconv.PURPOSE_POLICY)]
    fields = sample_fields(spans, INFO, AdapterConfig(trajectories=False), stats)
    assert [f["sample_id"] for f in fields] == ["r1.1/t0", "r1.1/t1"]
    assert stats == {SKIPPED_JUDGE_CALLS: 1, SKIPPED_OTHER_CALLS: 1}


def test_an_attempt_of_judge_calls_only_has_no_llm_call_and_still_counts_them() -> None:
    """Also with llm_call_match: a judge's call matched by name is left out."""
    stats: dict[str, int] = {}
    with pytest.raises(Skip) as skipped:
        sample_fields([call("j", 1.0, semconv.PURPOSE_JUDGE)], INFO, AdapterConfig(llm_call_match="^chat"), stats)
    assert skipped.value.code == "no_llm_call" and stats == {SKIPPED_JUDGE_CALLS: 1}
