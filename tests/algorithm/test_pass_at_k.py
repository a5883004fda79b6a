"""pass@k (the unbiased estimator) and maj@k: the pure functions, and a pass of k samples per task."""

from __future__ import annotations

import asyncio
import json
from math import comb
from pathlib import Path
from typing import Any

import pytest

from fulmen.records import Span
from fulmen.settings import AlgorithmSettings, EvaluatorSettings, load_settings
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen_algorithm.pass_at_k import (
    Sample,
    majority_solved,
    pass_at_k,
    pass_levels,
    pass_scores,
    score_fields,
)
from fulmen_algorithm.validation import GREEDY, PassSampling, validate


def test_pass_at_k_on_the_hand_checked_case_and_its_edges() -> None:
    """n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7; no success gives 0; n-c < k gives 1."""
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)
    assert pass_at_k(5, 0, 2) == 0.0 and pass_at_k(1, 0, 1) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 is c/n
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_pass_at_k_equals_the_binomial_form_and_stays_finite_for_large_n() -> None:
    """The product form equals 1 - C(n-c,k)/C(n,k) on every small case, and at n=1000 (where the
    binomials overflow a float) it still gives a number in [0, 1]."""
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12), (n, c, k)
    big = pass_at_k(1000, 3, 500)
    assert big == pytest.approx(1 - comb(997, 500) / comb(1000, 500), rel=1e-9) and 0 < big < 1


def test_the_levels_are_the_powers_of_two_up_to_k_and_k() -> None:
    """k=1 → [1]; 4 → [1, 2, 4]; 6 → [1, 2, 4, 6]."""
    assert pass_levels(1) == [1] and pass_levels(4) == [1, 2, 4] and pass_levels(6) == [1, 2, 4, 6]


def test_majority_vote_rules() -> None:
    """The most frequent answer wins, ties go to the answer given first, unanswered samples do not
    vote, and with no answer at all the vote is over success (more than half)."""
    assert majority_solved([Sample("5", False), Sample("4", True), Sample("5", False)]) is False
    assert majority_solved([Sample("4", True), Sample("5", False), Sample("4", True), Sample("6", False)]) is True
    assert majority_solved([Sample("4", True), Sample("5", False)]) is True  # tie: the first answer
    assert majority_solved([Sample("5", False), Sample("4", True)]) is False
    assert majority_solved([Sample(None, False), Sample(None, False), Sample("4", True)]) is True
    assert majority_solved([Sample(None, True), Sample(None, True), Sample(None, False)]) is True
    assert majority_solved([Sample(None, True), Sample(None, False)]) is False


def test_pass_scores_average_over_tasks_and_count_missing_samples_as_failed() -> None:
    """Two tasks of 4 samples: (2 right, 4 right); a third with one finished sample of 4."""
    a = [Sample("4", True), Sample("5", False), Sample("4", True), Sample("3", False)]
    b = [Sample("7", True)] * 4
    scores = pass_scores([a, b], 4)
    assert list(scores) == ["pass@1", "pass@2", "pass@4", "maj@4"]
    assert scores["pass@1"] == pytest.approx((0.5 + 1) / 2)
    assert scores["pass@2"] == pytest.approx((1 - comb(2, 2) / comb(4, 2) + 1) / 2)
    assert scores["pass@4"] == 1.0 and scores["maj@4"] == 1.0
    assert pass_scores([[Sample("1", True)]], 4) == {"pass@1": 0.25, "pass@2": 0.5, "pass@4": 1.0, "maj@4": 1.0}


# --- a pass through the store, with a stand-in runner -------------------------------------------

TASKS = [{"id": f"q{i}", "question": f"{i}+1=", "answer": str(i + 1)} for i in range(3)]
# What the stand-in model answers each task, sample by sample: q0 right twice of 4 (the tied vote
# goes to the wrong answer, given first), q1 right 3 times, q2 never (one sample failed, unanswered).
ANSWERS = {"q0": ["7", "1", "7", "1"], "q1": ["2", "2", "2", "9"], "q2": ["8", "8", None, "9"]}


async def _policy(store: RedisStore, sampling: dict[str, Any]) -> None:
    llm = {"kind": "llm", "model": "tiny", "model_version": "v3", "sampling_parameters": sampling}
    await store.resources.add_resources({"llm": llm}, resources_id="policy")


async def _stand_in_runner(store: RedisStore, expected: int) -> list[str]:
    """Claim ``expected`` val rollouts, answer each as ANSWERS says (an LLM span as the proxy writes
    it, the reward as the runner reports it); the rollout ids it saw."""
    seen: list[str] = []
    while len(seen) < expected:
        for c in await store.queue.dequeue_rollouts("stand-in", 16, block_s=0.5):
            rid, aid = c.rollout.rollout_id, c.attempt.attempt_id
            task, sample = c.rollout.input["id"], int(rid.rsplit("-s", 1)[1]) if "-s" in rid else 0
            answer = ANSWERS[task][sample]
            if answer is None:
                await store.rollouts.update_attempt(rid, aid, status="failed")
            else:
                await store.spans.add_spans([Span(rid, aid, f"llm-{aid}", "chat tiny", attributes={
                    semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.MODEL_VERSION: "v3",
                    semconv.RESPONSE_JSON: json.dumps({"role": "assistant", "content": f" {answer}\n"})})])
                reward = 1.0 if answer == c.rollout.input["answer"] else 0.0
                await store.rollouts.update_attempt(rid, aid, status="succeeded", reward=reward)
            seen.append(rid)
    return seen


async def test_a_pass_of_4_samples_records_pass_at_1_2_4_and_maj_at_4(real_store: RedisStore) -> None:
    """k=4 over three tasks: 12 sampled rollouts (the policy's temperature, its seed dropped), and the
    record holds accuracy = pass@1, pass@2, pass@4 and maj@4 by the estimator and the vote."""
    await _policy(real_store, {"temperature": 0.7, "seed": 3, "max_tokens": 8})
    running = asyncio.create_task(validate(real_store, TASKS, label="v3", step=3, timeout_s=30,
                                           sampling=PassSampling(4)))
    seen = await _stand_in_runner(real_store, 12)
    result = await asyncio.wait_for(running, 30)
    assert sorted(seen) == sorted(f"val-v3-q{i}-s{s}" for i in range(3) for s in range(4))
    sampled = (await real_store.resources.get_resources("validation-sampled")).resources["llm"]["sampling_parameters"]
    assert sampled == {"temperature": 0.7, "max_tokens": 8}
    c = [2, 3, 0]  # successes per task
    expected = {j: sum(1 - comb(4 - n, j) / comb(4, j) for n in c) / 3 for j in (1, 2, 4)}
    assert result["samples"] == 4 and result["temperature"] == 0.7 and result["finished"] == 12
    assert result["accuracy"] == pytest.approx(5 / 12) == pytest.approx(result["pass@1"])
    assert result["pass@1"] == pytest.approx(expected[1]) and result["pass@2"] == pytest.approx(expected[2])
    assert result["pass@4"] == pytest.approx(expected[4]) == pytest.approx(2 / 3)
    assert result["maj@4"] == pytest.approx(1 / 3)  # q0's vote is tied and "7" came first: only q1 counts
    assert result["served_by"] == {"v3": 11, "none": 1}
    [stored] = [json.loads(f[b"m"]) for _, f in await real_store.redis.xrange(real_store.keys.validations)]
    assert score_fields(stored) == {k: result[k] for k in ("samples", "pass@1", "pass@2", "pass@4", "maj@4")}


async def test_one_sample_is_todays_greedy_pass(real_store: RedisStore) -> None:
    """val_samples 1: rollout ids without a sample suffix, temperature 0, and no k-sample field."""
    await _policy(real_store, {"temperature": 0.7})
    running = asyncio.create_task(validate(real_store, TASKS, label="v0", timeout_s=30, sampling=GREEDY))
    seen = await _stand_in_runner(real_store, 3)
    result = await asyncio.wait_for(running, 30)
    assert sorted(seen) == ["val-v0-q0", "val-v0-q1", "val-v0-q2"]
    greedy = (await real_store.resources.get_resources("validation")).resources["llm"]["sampling_parameters"]
    assert greedy == {"temperature": 0.0}
    assert set(result) == {"label", "step", "tasks", "finished", "mean_reward", "accuracy", "served_by", "seconds", "time"}
    assert result["accuracy"] == pytest.approx(1 / 3)  # first samples: q1 right only


async def test_an_emitted_answer_wins_over_the_response_text(real_store: RedisStore) -> None:
    """An agent's fulmen.emit_object({"answer": ...}) is the answer that votes, not its model's text."""
    from fulmen_algorithm.validation import _attempt_view

    await real_store.rollouts.enqueue_rollout({"q": 1}, rollout_id="r1", mode="val")
    [c] = await real_store.queue.dequeue_rollouts("w", 1, block_s=1)
    aid = c.attempt.attempt_id
    await real_store.spans.add_spans([
        Span("r1", aid, "a", "chat", attributes={semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.MODEL_VERSION: "v2",
                                                 semconv.RESPONSE_JSON: json.dumps({"role": "assistant",
                                                                                    "content": "so it is 42"})}),
        Span("r1", aid, "b", "object", attributes={semconv.SPAN_KIND: semconv.KIND_OBJECT,
                                                   semconv.OBJECT_JSON: json.dumps({"answer": " 42 "})}),
    ])
    assert await _attempt_view(real_store, "r1") == ("v2", "42")


def test_the_evaluators_job_gets_the_samples_only_when_k_is_above_one(redis_url: str, experiment: str,
                                                                      tmp_path: Path) -> None:
    """val_samples 4 and val_temperature 0.5 reach the job as sampling=[4, 0.5]; with 1 the job's
    arguments stay as they were (no sampling keyword)."""
    from fulmen_algorithm.jobs import enqueue_validation, validation_job_id, validation_queue

    for version, samples in ((1, 1), (2, 4)):
        enqueue_validation(load_settings(AlgorithmSettings, redis_url=redis_url, experiment=experiment,
                                         val_data=tmp_path / "val.jsonl", val_samples=samples, val_temperature=0.5),
                           version)
    queue = validation_queue(EvaluatorSettings(redis_url=redis_url, experiment=experiment))
    try:
        assert "sampling" not in queue.fetch_job(validation_job_id(experiment, 1)).kwargs
        assert queue.fetch_job(validation_job_id(experiment, 2)).kwargs["sampling"] == [4, 0.5]
    finally:
        queue.connection.close()


def test_the_options_reach_algorithm_train_and_eval() -> None:
    """--val-samples and --val-temperature are options of fulmen algorithm, train, demo and eval."""
    from typer.testing import CliRunner

    from fulmen.cli import main as cli
    from fulmen.cli.main import app

    cli._add_service_commands()
    for command in ("algorithm", "train", "demo", "eval"):
        shown = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "300"}).stdout
        assert "--val-samples" in shown and "--val-temperature" in shown, command


def test_the_model_card_and_the_curve_show_the_k_sample_scores(tmp_path: Path) -> None:
    """A pass of 4 samples adds pass@1/2/4 and maj@4 columns to the card's validation table; the curve
    plots them without failing; a greedy-only table keeps its six columns."""
    from fulmen_algorithm.export import _validation_table
    from fulmen_algorithm.report import plot_curve

    greedy = {"label": "v0", "step": 0, "accuracy": 0.5, "mean_reward": 0.5, "tasks": 3, "served_by": {"v0": 3}}
    sampled = {**greedy, "label": "v2", "step": 2, "samples": 4, "pass@1": 0.5, "pass@2": 0.75, "pass@4": 0.9,
               "maj@4": 0.6}
    table = _validation_table([greedy, sampled])
    assert table[2].endswith("| tasks | pass@1 | pass@2 | pass@4 | maj@4 |")
    assert table[5].endswith("| 0.5000 | 0.7500 | 0.9000 | 0.6000 |") and table[4].endswith("| - | - | - | - |")
    assert _validation_table([greedy])[2].endswith("| tasks |")
    assert plot_curve(tmp_path / "curve.png", [], [greedy, sampled]).stat().st_size > 0
