"""Distillation: LLM calls answered by a text-only upstream (a teacher) become SFT samples — the
adapter tokenises them with the policy's tokenizer and chat template and marks them re-tokenised; the
SFT objective trains on them, RL objectives refuse them with the reason."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample, Span
from fulmen.settings import AdapterSettings, TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen_adapter import triplets
from fulmen_adapter.config import adapter_config
from fulmen_adapter.retokenize import Retokenizer
from fulmen_adapter.triplets import AdapterConfig, AttemptInfo, Skip
from fulmen_trainer.groups import GroupCollector

INFO = AttemptInfo("r1", "r1.1", "task-a", mode="train", group_size=2, reward=1.0)
QUESTION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "what is 12+30?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _text_only_call(span_id: str, t: float, messages: list[dict[str, Any]], answer: Any, **extra: Any) -> Span:
    """A call as the proxy records a text-only upstream's answer: request and response, no token ids."""
    attributes = {semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.TOKEN_FIDELITY: "text_only",
                  semconv.MODEL_VERSION: "teacher", semconv.REQUEST_JSON: json.dumps({"messages": messages, **extra}),
                  semconv.RESPONSE_JSON: json.dumps(answer)}
    return Span(rollout_id="r1", attempt_id="r1.1", span_id=span_id, name="chat teacher", trace_id="t" * 32,
                parent_id=None, start_time=t, end_time=t + 1, attributes=attributes, sequence_id=int(t * 10) + 1)


def _samples(spans: list[Span], config: AdapterConfig) -> list[Sample]:
    return [Sample.from_wire(s.to_wire()) for s in triplets.spans_to_samples(spans, INFO, config)]


def test_a_teachers_chat_answer_becomes_a_retokenized_sample(tiny: Path) -> None:
    retokenize = Retokenizer(tiny)
    tok = retokenize.tokenizer
    answer = {"role": "assistant", "content": "42"}
    (sample,) = _samples([_text_only_call("c1", 1.0, QUESTION, answer)], AdapterConfig(retokenize=retokenize))
    assert sample.retokenized
    assert sample.prompt_token_ids == retokenize._render(QUESTION, None, add_generation_prompt=True)
    whole = retokenize._render([*QUESTION, answer], None, add_generation_prompt=False)
    assert whole == list(tok.apply_chat_template([*QUESTION, answer], tokenize=True, return_dict=True)["input_ids"])
    assert sample.prompt_token_ids + sample.response_token_ids == whole
    assert tok.decode(sample.response_token_ids) == "42" + tok.eos_token  # the answer, then the end of the turn
    assert sample.response_mask == [1] * len(sample.response_token_ids)
    assert sample.response_logprobs == [0.0] * len(sample.response_token_ids)  # none: the teacher gave none
    assert sample.final_reward == 1.0 and sample.model_version == "teacher"


def test_a_multi_turn_teacher_conversation_is_one_trajectory_masked_to_the_answers(tiny: Path) -> None:
    retokenize = Retokenizer(tiny)
    first = {"role": "assistant", "content": "42"}
    follow_up = [*QUESTION, first, {"role": "user", "content": "and 42+1?"}]
    spans = [_text_only_call("c1", 1.0, QUESTION, first),
             _text_only_call("c2", 2.0, follow_up, {"role": "assistant", "content": "43"})]
    samples = _samples(spans, AdapterConfig(retokenize=retokenize))
    (trajectory,) = [s for s in samples if s.shape == "trajectory"]
    assert trajectory.retokenized and trajectory.num_turns == 2
    tok = retokenize.tokenizer
    model_text = tok.decode([t for t, m in zip(trajectory.response_token_ids, trajectory.response_mask, strict=True) if m])
    assert model_text == f"42{tok.eos_token}43{tok.eos_token}"  # the user's turn between is masked out


def test_without_a_tokenizer_a_text_only_call_is_skipped_and_says_how() -> None:
    with pytest.raises(Skip) as caught:
        triplets.spans_to_samples([_text_only_call("c1", 1.0, QUESTION, {"role": "assistant", "content": "42"})],
                                  INFO, AdapterConfig())
    assert caught.value.code == "no_token_ids" and "--tokenizer-dir" in str(caught.value)


@pytest.mark.parametrize(("request_extra", "answer", "says"), [
    ({"messages": "not a list"}, {"role": "assistant", "content": "x"}, "neither messages nor a prompt"),
    ({}, None, "no assistant message"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, {"role": "assistant", "content": "x"}, "cannot render"),
])
def test_a_call_that_cannot_be_retokenized_is_skipped_with_the_reason(
        tiny: Path, request_extra: dict[str, Any], answer: Any, says: str) -> None:
    span = _text_only_call("c1", 1.0, QUESTION, answer)
    if request_extra:
        request = {"messages": QUESTION, **request_extra}
        span = replace(span, attributes={**span.attributes, semconv.REQUEST_JSON: json.dumps(request)})
    with pytest.raises(Skip) as caught:
        triplets.spans_to_samples([span], INFO, AdapterConfig(retokenize=Retokenizer(tiny)))
    assert caught.value.code == "retokenize_failed" and says in str(caught.value)


def test_the_adapter_setting_names_the_tokenizer(tiny: Path, tmp_path: Path) -> None:
    assert adapter_config(load_settings(AdapterSettings)).retokenize is None
    assert isinstance(adapter_config(load_settings(AdapterSettings, tokenizer_dir=tiny)).retokenize, Retokenizer)
    with pytest.raises(ValueError, match="is not a folder"):
        adapter_config(load_settings(AdapterSettings, tokenizer_dir=tmp_path / "nothing"))
    with pytest.raises(ValueError, match="no tokenizer could be loaded"):
        adapter_config(load_settings(AdapterSettings, tokenizer_dir=tmp_path))


def _retokenized(rollout: str, version: str | None = "teacher") -> Sample:
    return Sample(f"{rollout}.1/t0", "triplet", rollout, f"{rollout}.1", "g", 0, [1, 5, 9], [20, 21, 2],
                  [0.0, 0.0, 0.0], [1, 1, 1], 1.0, 1.0, version, mode="train", group_size=2, retokenized=True)


def test_rl_refuses_retokenized_samples_and_sft_keeps_them_whatever_their_version(caplog) -> None:  # type: ignore[no-untyped-def]
    rl = GroupCollector(max_staleness=0)
    for i in range(2):
        rl.add(f"1-{i}", _retokenized(f"r{i}"))
    (ready,) = rl.take_complete(7)
    assert ready.samples == [] and rl.counts["samples/refused_retokenized"] == 2
    assert "--algorithm sft" in caplog.text
    sft = GroupCollector(max_staleness=0, rl=False)  # a teacher's answer is never stale
    for i in range(2):
        sft.add(f"1-{i}", _retokenized(f"r{i}"))
    (ready,) = sft.take_complete(7)
    assert [s.rollout_id for s in ready.samples] == ["r0", "r1"] and ready.weights == [1.0, 1.0]


async def test_sft_trains_on_retokenized_samples(real_store: RedisStore, tiny: Path, tmp_path: Path) -> None:
    """The SFT objective takes re-tokenised samples: a step that trains on them changes the weights."""
    from fulmen import keys as k
    from fulmen_trainer.trainer import Trainer

    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    for i in range(2):
        await real_store.redis.xadd(real_store.keys.samples, {"m": _retokenized(f"r{i}").to_wire()})
    settings = load_settings(TrainerSettings, model_dir=tiny, algorithm="sft", groups_per_step=1, max_steps=1,
                             checkpoint_dir=tmp_path / "ck", metrics_file=tmp_path / "m.jsonl",
                             experiment=real_store.experiment, learning_rate=1e-3, max_staleness=0)
    trainer = Trainer(real_store, settings)
    await trainer.setup()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    await asyncio.wait_for(trainer.run(asyncio.Event()), 60)
    assert trainer.step == 1
    assert any(not (p.detach() == before[n]).all() for n, p in trainer.model.named_parameters())
    (line,) = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert sorted(line["sample_ids"]) == ["r0.1/t0", "r1.1/t0"]
