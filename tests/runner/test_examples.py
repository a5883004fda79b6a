"""The agents in examples/ run through `fulmen run-once` against a scripted OpenAI-compatible server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from fakes.fake_openai import FakeOpenAI
from runner_processes import (
    FulmenProcess,
    FulmenProcesses,
    child_env,
    wait_until_ready,
)

from fulmen.records import Rollout
from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.telemetry.tracing import rollout_trace_id

pytestmark = pytest.mark.slow

QUESTION = {"question": "What is 17 * 23?", "answer": 391}
CALCULATOR_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": json.dumps({"expression": "17 * 23"})},
}






@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    server = FakeOpenAI(model="fake")
    await server.start()
    yield server
    await server.close()


async def _run_example(
    store: RedisStore, procs: FulmenProcesses, fake: FakeOpenAI, example: str, *args: str
) -> tuple[FulmenProcess, Rollout]:
    """`fulmen run-once` of ``examples.<example>:agent`` on QUESTION, with an "llm" resource published."""
    await store.resources.add_resources(
        {"llm": {"kind": "llm", "model": "fake", "sampling_parameters": {"temperature": 0.0}}}
    )
    process = await procs.start(
        "run-once",
        "--agent", f"examples.{example}:agent",
        "--task", json.dumps(QUESTION),
        "--llm-base-url", f"{fake.base_url}/v1",
        *args,
    )  # fmt: skip
    await process.wait()
    (rollout,) = await store.rollouts.query_rollouts()
    return process, rollout


def _assert_attributed(fake: FakeOpenAI, rollout: Rollout) -> None:
    """Every model call went to the chat endpoint under the attempt's path (the ids travel in the URL,
    which any client keeps), with the model and sampling parameters."""
    assert fake.requests, "the agent called no model"
    for request in fake.requests:
        assert request.path == f"/rollout/{rollout.rollout_id}/attempt/{rollout.attempt_id}/v1/chat/completions"
        assert request.body["model"] == "fake"
        assert request.body["temperature"] == 0.0


async def test_single_turn_example_scores_a_right_answer(real_store, procs, fake) -> None:
    """The single-turn example asks the model once and prints reward 1.0 for the exact answer."""
    fake.script("17 * 23 = 391")
    done, rollout = await _run_example(real_store, procs, fake, "single_turn_agent")
    assert done.process.returncode == 0, done.stderr
    assert "status: succeeded  reward: 1.0" in done.stdout
    assert "Unclosed" not in done.stderr  # the loop's HTTP pool is closed before the loop ends
    assert rollout.status is RolloutStatus.SUCCEEDED
    _assert_attributed(fake, rollout)
    (request,) = fake.requests
    assert [m["role"] for m in request.body["messages"]] == ["system", "user"]
    assert request.body["messages"][1]["content"] == QUESTION["question"]
    spans = await real_store.spans.query_spans(rollout.rollout_id)
    assert [s.name for s in spans] == [semconv.MESSAGE_SPAN, semconv.ROLLOUT_SPAN, semconv.REWARD_SPAN]
    assert spans[0].attributes[semconv.MESSAGE] == "reply: 17 * 23 = 391"
    assert spans[-1].attributes[semconv.REWARD] == 1.0


async def test_single_turn_example_scores_a_wrong_answer_zero(real_store, procs, fake) -> None:
    """A wrong answer is a succeeded rollout with reward 0.0 (the check is exact)."""
    fake.script("390")
    done, rollout = await _run_example(real_store, procs, fake, "single_turn_agent", "--json")
    assert done.process.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["status"], result["reward"]) == ("succeeded", 0.0)
    (reward,) = await real_store.spans.query_spans(rollout.rollout_id, name=semconv.REWARD_SPAN)
    assert reward.attributes[semconv.REWARD] == 0.0


async def test_multi_turn_example_runs_the_tool_and_scores_the_answer(real_store, procs, fake) -> None:
    """The tool example runs the calculator the model asks for, sends the result back, and scores the final answer."""
    fake.script({"tool_calls": [CALCULATOR_CALL]}, "391")
    done, rollout = await _run_example(real_store, procs, fake, "multi_turn_tool_agent", "--json")
    assert done.process.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["rollout_id"], result["status"], result["reward"]) == (rollout.rollout_id, "succeeded", 1.0)

    _assert_attributed(fake, rollout)
    first, second = fake.requests
    assert first.body["tools"][0]["function"]["name"] == "calculator"
    assistant, tool = second.body["messages"][-2:]
    assert assistant["role"] == "assistant"
    assert assistant["tool_calls"][0]["id"] == "call_1"
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": "391"}
    for request in fake.requests:  # the ready-made client passes the rollout's trace on
        trace_id = request.headers["traceparent"].split("-")[1]
        assert int(trace_id, 16) == rollout_trace_id(rollout.rollout_id)

    spans = await real_store.spans.query_spans(rollout.rollout_id)
    assert [s.name for s in spans] == [
        "calculator",
        semconv.MESSAGE_SPAN,
        semconv.ROLLOUT_SPAN,
        semconv.REWARD_SPAN,
    ]
    calculator = spans[0]
    assert json.loads(calculator.attributes[semconv.OPERATION_INPUT]) == {
        "args": [],
        "kwargs": {"expression": "17 * 23"},
    }
    assert calculator.attributes[semconv.OPERATION_OUTPUT] == '"391"'
    assert spans[1].attributes[semconv.MESSAGE] == "answer: 391"
    assert spans[-1].attributes[semconv.REWARD] == 1.0
    assert [s["sequence_id"] for s in result["spans"]] == [s.sequence_id for s in spans]


async def test_multi_turn_example_under_a_runner_process(real_store, procs, fake) -> None:
    """Under `fulmen runner` (FULMEN_LLM_BASE_URL), the tool example's rollouts succeed with reward 1.0."""
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "fake"}})
    env = child_env(procs.redis_url, procs.experiment, FULMEN_LLM_BASE_URL=f"{fake.base_url}/v1")
    # One slot: the fake answers in script order, so rollouts must not interleave their turns.
    runner = await procs.runner("examples.multi_turn_tool_agent:agent", "--concurrency", "1", env=env)
    await wait_until_ready(real_store, runner)
    fake.script({"tool_calls": [CALCULATOR_CALL]}, "391", {"tool_calls": [CALCULATOR_CALL]}, "390")
    ids = [(await real_store.rollouts.enqueue_rollout(QUESTION)).rollout_id for _ in range(2)]
    assert len(await real_store.finished.wait_for_rollouts(ids, timeout_s=120)) == 2
    rewards = []
    for rid in ids:
        assert (await real_store.rollouts.get_rollout(rid)).status is RolloutStatus.SUCCEEDED
        spans = await real_store.spans.query_spans(rid)
        assert [s.name for s in spans] == [
            "calculator", semconv.MESSAGE_SPAN, semconv.ROLLOUT_SPAN, semconv.REWARD_SPAN
        ]
        rewards.append(spans[-1].attributes[semconv.REWARD])
    assert rewards == [1.0, 0.0]
    assert len(fake.requests) == 4
