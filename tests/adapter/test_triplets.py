"""Spans → samples on recorded span sets; the expected samples are asserted exactly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fulmen.records import Sample, Span
from fulmen.telemetry import semconv
from fulmen_adapter import triplets
from fulmen_adapter.triplets import AdapterConfig, AttemptInfo, Skip


def spans_to_samples(*args: Any, **kwargs: Any) -> list[Sample]:
    """The adapter's samples as the trainer reads them (token fields as lists, via the wire)."""
    return [Sample.from_wire(s.to_wire()) for s in triplets.spans_to_samples(*args, **kwargs)]

INFO = AttemptInfo("r1", "r1.1", "task-a", mode="train", group_size=4)
_seq = iter(range(1, 10_000))


def _span(span_id: str, name: str, parent: str | None, t0: float, t1: float, **attributes: Any) -> Span:
    return Span(
        rollout_id="r1", attempt_id="r1.1", span_id=span_id, name=name, trace_id="t" * 32, parent_id=parent,
        start_time=t0, end_time=t1, attributes=attributes, sequence_id=next(_seq),
    )


def root(t0: float = 0.0, t1: float = 100.0) -> Span:
    return _span("root", semconv.ROLLOUT_SPAN, None, t0, t1, **{semconv.SPAN_KIND: semconv.KIND_ROLLOUT})


def llm(span_id: str, t0: float, t1: float, prompt: list[int], response: list[int], *, parent: str | None = "root",
        messages: list[dict[str, Any]] | None = None, answer: str = "", version: str = "v1",
        response_id: str | None = None, name: str = "chat tiny") -> Span:
    attributes: dict[str, Any] = {
        semconv.SPAN_KIND: semconv.KIND_LLM_CALL,
        semconv.PROMPT_TOKEN_IDS: prompt,
        semconv.RESPONSE_TOKEN_IDS: response,
        semconv.RESPONSE_LOGPROBS: [-0.5] * len(response),
        semconv.MODEL_VERSION: version,
        semconv.REQUEST_JSON: json.dumps({"messages": messages or [{"role": "user", "content": "q"}]}),
        semconv.RESPONSE_JSON: json.dumps({"role": "assistant", "content": answer}),
    }
    if response_id:
        attributes[semconv.GEN_AI_RESPONSE_ID] = response_id
    return _span(span_id, name, parent, t0, t1, **attributes)


def reward(span_id: str, t: float, value: float, parent: str | None = "root") -> Span:
    return _span(span_id, semconv.REWARD_SPAN, parent, t, t,
                 **{semconv.SPAN_KIND: semconv.KIND_REWARD, semconv.REWARD: value})


def triplet(turn: int, prompt: list[int], response: list[int], reward: float | None, final: float,
            *, prompt_text: str = "q", answer: str = "", messages: list[dict[str, Any]] | None = None) -> Sample:
    return Sample(
        sample_id=f"r1.1/t{turn}", shape="triplet", rollout_id="r1", attempt_id="r1.1", group_key="task-a",
        turn_index=turn, prompt_token_ids=prompt, response_token_ids=response,
        response_logprobs=[-0.5] * len(response), response_mask=[1] * len(response), reward=reward,
        final_reward=final, model_version="v1", mode="train", group_size=4, num_turns=1,
        request_json=json.dumps({"messages": messages or [{"role": "user", "content": "q"}]}),
        response_json=json.dumps({"role": "assistant", "content": answer}),
    )


def test_single_turn() -> None:
    """One call and its reward: one triplet carrying the ids, logprobs, version, texts and reward."""
    spans = [llm("c1", 1, 2, [1, 2, 3], [4, 5], answer="42"), reward("w", 3, 1.0), root()]
    assert spans_to_samples(spans, INFO) == [triplet(0, [1, 2, 3], [4, 5], 1.0, 1.0, answer="42")]


def test_multi_turn_with_tool_calls_joins_a_trajectory() -> None:
    """Turns that extend each other become triplets plus one trajectory masked to the model's tokens."""
    tool_call = {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]}
    turn2_messages = [{"role": "user", "content": "q"}, tool_call, {"role": "tool", "tool_call_id": "t1", "content": "7"}]
    spans = [
        root(),
        llm("c1", 1, 2, [1, 2], [3, 4], answer=""),
        _span("tool", "calc", "root", 2.5, 2.6),
        llm("c2", 3, 4, [1, 2, 3, 4, 9, 9], [5], messages=turn2_messages, answer="7"),
        reward("w", 5, 1.0),
    ]
    samples = spans_to_samples(spans, INFO)
    assert samples[:2] == [
        triplet(0, [1, 2], [3, 4], None, 1.0),
        triplet(1, [1, 2, 3, 4, 9, 9], [5], 1.0, 1.0, prompt_text="q", answer="7", messages=turn2_messages),
    ]
    assert samples[2] == Sample(
        sample_id="r1.1/traj0", shape="trajectory", rollout_id="r1", attempt_id="r1.1", group_key="task-a",
        turn_index=0, prompt_token_ids=[1, 2], response_token_ids=[3, 4, 9, 9, 5],
        response_logprobs=[-0.5, -0.5, 0.0, 0.0, -0.5], response_mask=[1, 1, 0, 0, 1], reward=1.0,
        final_reward=1.0, model_version="v1", mode="train", group_size=4, num_turns=2,
        request_json=json.dumps({"messages": turn2_messages}),
        response_json=json.dumps({"role": "assistant", "content": "7"}),
    )
    # the messages view, for SFT and APO: the conversation, then the answer
    assert samples[2].messages == [*turn2_messages, {"role": "assistant", "content": "7"}]
    assert (samples[2].prompt_text, samples[2].response_text) == ("q", "7")


def test_turns_that_do_not_extend_each_other_stay_apart() -> None:
    """A second call with a fresh prompt is its own triplet; no trajectory joins them."""
    spans = [root(), llm("c1", 1, 2, [1, 2], [3]), llm("c2", 3, 4, [7, 8], [9]), reward("w", 5, 0.5)]
    assert [s.sample_id for s in spans_to_samples(spans, INFO)] == ["r1.1/t0", "r1.1/t1"]


def test_several_rewards_go_to_the_most_recent_unrewarded_call() -> None:
    """Each reward goes to the latest earlier call without one; the last reward is the final one."""
    spans = [
        root(),
        llm("c1", 1, 2, [1], [2]),
        reward("w1", 2.5, 0.1),
        llm("c2", 3, 4, [5], [6]),
        llm("c3", 5, 6, [7], [8]),
        reward("w2", 7, 0.2),
        reward("w3", 8, 0.3),
    ]
    samples = spans_to_samples(spans, INFO)
    assert [(s.sample_id, s.reward, s.final_reward) for s in samples] == [
        ("r1.1/t0", 0.1, 0.3),
        ("r1.1/t1", 0.3, 0.3),  # w2 took c3, the most recent; w3 then falls back to c2
        ("r1.1/t2", 0.2, 0.3),
    ]


def test_reward_before_any_call_matches_no_call() -> None:
    """A reward emitted before the first call rewards no call, yet counts as the final reward if last."""
    spans = [root(), reward("w0", 0.5, 0.9), llm("c1", 1, 2, [1], [2]), reward("w1", 3, 0.4)]
    (only,) = spans_to_samples(spans, INFO)
    assert (only.reward, only.final_reward) == (0.4, 0.4)
    spans = [root(), reward("w0", 0.5, 0.9), llm("c1", 1, 2, [1], [2])]
    (only,) = spans_to_samples(spans, INFO)
    assert (only.reward, only.final_reward) == (None, 0.9)


def test_missing_parents_are_repaired_to_the_root() -> None:
    """A call whose parent was never stored still counts, under the root (agent filter included)."""
    spans = [root(), llm("c1", 1, 2, [1], [2], parent="lost"), reward("w", 3, 1.0, parent="lost-too")]
    (s,) = spans_to_samples(spans, INFO, AdapterConfig(agent_match="fulmen.rollout"))
    assert (s.reward, s.prompt_token_ids) == (1.0, [1])


def test_agent_filter_keeps_only_calls_under_the_matching_agent() -> None:
    """With agent_match, calls outside a matching agent span are left out."""
    spans = [
        root(),
        _span("a", "agent.solver", "root", 0.5, 10),
        _span("b", "agent.critic", "root", 0.5, 10),
        llm("c1", 1, 2, [1], [2], parent="a"),
        llm("c2", 3, 4, [3], [4], parent="b"),
        reward("w", 5, 1.0),
    ]
    samples = spans_to_samples(spans, INFO, AdapterConfig(agent_match=r"solver"))
    assert [s.prompt_token_ids for s in samples] == [[1]]


def test_duplicated_spans_and_responses_count_once() -> None:
    """The same span stored twice, a client span around the proxy's, and a repeated response id: one call."""
    call = llm("c1", 1, 2, [1], [2], response_id="resp-1")
    client = _span("client", "openai.chat", "root", 0.9, 2.1, **{semconv.SPAN_KIND: semconv.KIND_LLM_CALL,
                   semconv.PROMPT_TOKEN_IDS: [1], semconv.RESPONSE_TOKEN_IDS: [2], semconv.RESPONSE_LOGPROBS: [-0.5]})
    nested = llm("c1-inner", 1.1, 1.9, [1], [2], parent="client")
    repeat = llm("c1-again", 1, 2, [1], [2], response_id="resp-1")
    spans = [root(), call, call, client, nested, repeat, reward("w", 3, 1.0)]
    samples = spans_to_samples(spans, INFO)
    assert [s.prompt_token_ids for s in samples] == [[1], [1]]  # c1 and the outer client span only
    assert len({s.sample_id for s in samples}) == 2


def test_spans_of_another_attempt_are_ignored() -> None:
    """Only the given attempt's spans count."""
    other = Span("r1", "r1.0", "x", "chat", attributes={semconv.SPAN_KIND: semconv.KIND_LLM_CALL}, sequence_id=0)
    spans = [root(), other, llm("c1", 1, 2, [1], [2]), reward("w", 3, 1.0)]
    assert len(spans_to_samples(spans, INFO)) == 1


@pytest.mark.parametrize(
    ("spans", "reason"),
    [
        ([root(), reward("w", 1, 1.0)], "no LLM call"),
        ([root(), llm("c1", 1, 2, [1], [2])], "no reward"),
        ([root(), llm("c1", 1, 2, [1], ["x"]), reward("w", 3, 1.0)], "response token ids"),  # type: ignore[list-item]
        ([root(), llm("c1", 1, 2, [1], [2]), reward("w", 3, float("nan"))], "not a finite number"),
    ],
)
def test_skips_say_why(spans: list[Span], reason: str) -> None:
    """No call, no reward, or a malformed span: no sample, and the reason."""
    with pytest.raises(Skip, match=reason):
        spans_to_samples(spans, INFO)


def test_text_only_calls_are_skipped_with_the_backend_named() -> None:
    """A call from a text-only backend has no token ids: skipped, saying so."""
    span = _span("c1", "chat", "root", 1, 2, **{semconv.SPAN_KIND: semconv.KIND_LLM_CALL,
                 semconv.TOKEN_FIDELITY: "text_only"})
    with pytest.raises(Skip, match="text_only"):
        spans_to_samples([root(), span, reward("w", 3, 1.0)], INFO)


def test_a_retried_call_is_one_sample() -> None:
    """Two spans of one logical call (same call key, different span ids): one triplet, the retry's."""
    first = llm("c1", 1, 2, [1, 2], [3], answer="lost")
    retry = llm("c2", 3, 4, [1, 2], [4], answer="seen")
    other = llm("c3", 5, 6, [7], [8], answer="next")
    for span, key in ((first, "k1"), (retry, "k1"), (other, "k2")):
        span.attributes[semconv.CALL_KEY] = key
    spans = [root(), first, retry, other, reward("r", 7, 1.0)]
    samples = spans_to_samples(spans, INFO)
    assert [(s.sample_id, s.response_token_ids) for s in samples] == [("r1.1/t0", [4]), ("r1.1/t1", [8])]


def test_calls_stored_as_int32_before_join_calls_stored_as_planes() -> None:
    """A rollout whose first call was stored as int32 bytes (written before byte planes) and whose second
    is planes: the same triplets and trajectory as from lists."""
    from array import array

    from fulmen import tokens

    def spans(first_prompt: Any, first_response: Any, second_prompt: Any) -> list[Span]:
        first = llm("c1", 1, 2, first_prompt, first_response)
        first.attributes[semconv.RESPONSE_LOGPROBS] = [-0.5] * 2
        return [root(), first, llm("c2", 3, 4, second_prompt, [5]), reward("w", 5, 1.0)]

    as_lists = spans([1, 2], [3, 70_000], [1, 2, 3, 70_000, 9])
    mixed = spans(array("i", [1, 2]).tobytes(), array("i", [3, 70_000]).tobytes(), tokens.pack_ids([1, 2, 3, 70_000, 9]))
    expected = spans_to_samples(as_lists, INFO)
    assert [s.shape for s in expected] == ["triplet", "triplet", "trajectory"]
    assert expected[2].response_token_ids == [3, 70_000, 9, 5] and expected[2].response_mask == [1, 1, 0, 1]
    assert spans_to_samples(mixed, INFO) == expected
