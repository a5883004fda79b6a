"""Each framework example in examples/<framework>/ runs with the real framework through `fulmen run-once`
→ the torch-backend proxy serving the tiny model → the adapter's `spans_to_samples`: the rollout
succeeds with a reward, its LLM calls are spans on its attempt, and the samples carry the token ids
and log-probabilities the proxy recorded (rendered by the model's own chat template, never
re-tokenised). The tiny model is random, so no example may depend on it calling the tool; the
multi-turn one (anthropic) asks again when the answer is not a number, which makes several calls of
one conversation: one trajectory sample whose mask is 1 on exactly the model's tokens.

The anthropic one runs under a `fulmen runner` process (queued, claimed), the others under `fulmen
run-once`. The frameworks come with the ``dev`` extra (``frameworks``); a missing one skips its test, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from proxy_helpers import RunningProxy
from runner_processes import FulmenProcesses, child_env, wait_until_ready

from fulmen import tokens
from fulmen.demo.tiny_model import load_tiny_model
from fulmen.records import Rollout, Sample, Span
from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen_adapter.triplets import AttemptInfo, spans_to_samples
from fulmen_llm_proxy.recording import API_ATTRIBUTE

pytestmark = pytest.mark.slow

QUESTION = {"question": "What is 17 * 23?", "answer": 391}
# Greedy, so each run of the random model says the same; short answers keep the prompts in its context.
SAMPLING = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return load_tiny_model(tiny_model)[1]


def _needs(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed: pip install -e '.[dev]' (the frameworks extra)")


async def _serve(procs: FulmenProcesses) -> None:
    """`fulmen serve`: the policy resources name the model and the run's sampling, as a user publishes them."""
    served = await procs.start("serve", "--model-name", "tiny", "--sampling", json.dumps(SAMPLING))
    assert await served.wait(timeout_s=60) == 0, served.stderr


async def _run_example(
    store: RedisStore, procs: FulmenProcesses, proxy: RunningProxy, agent: str
) -> tuple[Rollout, list[Span]]:
    """`fulmen run-once --agent <agent>` on QUESTION against the proxy: the ended rollout and its spans."""
    await _serve(procs)
    done = await procs.start(
        "run-once", "--agent", agent, "--task", json.dumps(QUESTION), "--llm-base-url", proxy.base(), "--json"
    )
    code = await done.wait(timeout_s=180)
    assert code == 0, done.stderr[-6000:] + "\nSTDOUT " + done.stdout[-700:]
    result = json.loads(done.stdout)
    rollout = await store.rollouts.get_rollout(result["rollout_id"])
    assert rollout is not None and rollout.status is RolloutStatus.SUCCEEDED
    assert rollout.reward in (0.0, 1.0) and result["reward"] == rollout.reward
    return rollout, await store.spans.query_spans(rollout.rollout_id)


async def _run_under_runner(
    store: RedisStore, procs: FulmenProcesses, proxy: RunningProxy, agent: str
) -> tuple[Rollout, list[Span]]:
    """QUESTION queued and claimed by a `fulmen runner --agent <agent>` on the proxy: the ended rollout
    and its spans."""
    await _serve(procs)
    env = child_env(procs.redis_url, procs.experiment, FULMEN_LLM_BASE_URL=proxy.base())
    runner = await procs.runner(agent, "--concurrency", "1", env=env)
    await wait_until_ready(store, runner)
    queued = await store.rollouts.enqueue_rollout(QUESTION)
    (rollout,) = await store.finished.wait_for_rollouts([queued.rollout_id], timeout_s=120)
    assert rollout.status is RolloutStatus.SUCCEEDED, runner.stderr[-6000:]
    assert rollout.reward in (0.0, 1.0)
    return rollout, await store.spans.query_spans(rollout.rollout_id)


def _llm_calls(rollout: Rollout, spans: list[Span], api: str | None) -> list[Span]:
    """The rollout's LLM call spans, each recorded on its attempt through ``api`` (None: chat completions)."""
    calls = [s for s in spans if s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL]
    assert calls, f"no LLM call recorded: {[s.name for s in spans]}"
    for call in calls:
        assert call.attributes[semconv.ATTEMPT_ID] == rollout.attempt_id
        assert call.attributes.get(API_ATTRIBUTE) == api
        assert call.attributes[semconv.TOKEN_FIDELITY] == "exact"
    return calls


def _samples_carry_the_proxys_ids(rollout: Rollout, spans: list[Span], calls: list[Span], tokenizer: Any) -> list[Sample]:
    """The adapter's samples: one triplet per call with that call's recorded ids and log-probabilities;
    the prompt ids are the model's chat template over the messages the framework sent, and the
    response ids decode to the text the framework got back."""
    info = AttemptInfo(rollout.rollout_id, rollout.attempt_id, "g", mode="train", group_size=1, reward=rollout.reward)
    samples = spans_to_samples(spans, info)
    triplets = [s for s in samples if s.shape == "triplet"]
    assert len(triplets) == len(calls)
    for sample, call in zip(triplets, calls, strict=True):
        a = call.attributes
        prompt, response = tokens.ids(a[semconv.PROMPT_TOKEN_IDS]), tokens.ids(a[semconv.RESPONSE_TOKEN_IDS])
        assert tokens.ids(sample.prompt_token_ids) == prompt and tokens.ids(sample.response_token_ids) == response
        assert tokens.floats(sample.response_logprobs) == tokens.floats(a[semconv.RESPONSE_LOGPROBS])
        assert len(tokens.floats(sample.response_logprobs)) == len(response) > 0
        assert not sample.retokenized and sample.final_reward == rollout.reward
        request = json.loads(a[semconv.REQUEST_JSON])
        # the torch backend renders the request's tools into the prompt unless tool_choice is "none"
        tools = request.get("tools") if request.get("tool_choice") != "none" else None
        rendered = tokenizer.apply_chat_template(request["messages"], tools=tools, add_generation_prompt=True,
                                                 tokenize=False)
        assert prompt == tokenizer.encode(rendered, add_special_tokens=False)
        answer = json.loads(a[semconv.RESPONSE_JSON])
        if not answer.get("tool_calls"):
            assert tokenizer.decode(response, skip_special_tokens=True) == (answer.get("content") or "")
    return samples


async def test_langgraph_react_agent(torch_proxy, proxy_store, procs, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """LangGraph's ReAct agent through langchain-openai's ChatOpenAI: chat completions with the tool."""
    _needs("langgraph")
    _needs("langchain_openai")
    rollout, spans = await _run_example(proxy_store, procs, torch_proxy, "examples.langgraph.agent:agent")
    calls = _llm_calls(rollout, spans, None)
    assert json.loads(calls[0].attributes[semconv.REQUEST_JSON])["tools"][0]["function"]["name"] == "calculator"
    _samples_carry_the_proxys_ids(rollout, spans, calls, tokenizer)


@pytest.mark.parametrize(
    ("agent", "api"), [("agent", "openai.responses"), ("chat_agent", None)], ids=["responses", "chat-completions"]
)
async def test_openai_agents_sdk(torch_proxy, proxy_store, procs, tokenizer, agent: str, api: str | None) -> None:  # type: ignore[no-untyped-def]
    """The OpenAI Agents SDK with its Responses model and with its chat-completions model."""
    _needs("agents")
    rollout, spans = await _run_example(proxy_store, procs, torch_proxy, f"examples.openai_agents.agent:{agent}")
    calls = _llm_calls(rollout, spans, api)
    assert json.loads(calls[0].attributes[semconv.REQUEST_JSON])["tools"][0]["function"]["name"] == "calculator"
    _samples_carry_the_proxys_ids(rollout, spans, calls, tokenizer)


async def test_autogen_assistant_agent(torch_proxy, proxy_store, procs, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """AutoGen AgentChat's AssistantAgent through autogen-ext's OpenAI client."""
    _needs("autogen_agentchat")
    _needs("autogen_ext.models.openai")
    rollout, spans = await _run_example(proxy_store, procs, torch_proxy, "examples.autogen.agent:agent")
    calls = _llm_calls(rollout, spans, None)
    assert json.loads(calls[0].attributes[semconv.REQUEST_JSON])["tools"][0]["function"]["name"] == "calculator"
    _samples_carry_the_proxys_ids(rollout, spans, calls, tokenizer)


async def test_anthropic_tool_use_loop_is_one_trajectory(torch_proxy, proxy_store, procs, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The anthropic SDK's loop on /v1/messages, under a `fulmen runner`: several calls of one
    conversation, joined into a trajectory sample whose mask is 1 on exactly each call's response
    ids, 0 on what came between."""
    _needs("anthropic")
    rollout, spans = await _run_under_runner(proxy_store, procs, torch_proxy, "examples.anthropic.agent:agent")
    calls = _llm_calls(rollout, spans, "anthropic.messages")
    assert len(calls) >= 2, "the loop asks again for a bare number: at least two calls"
    samples = _samples_carry_the_proxys_ids(rollout, spans, calls, tokenizer)
    prompts = [tokens.ids(c.attributes[semconv.PROMPT_TOKEN_IDS]) for c in calls]
    responses = [tokens.ids(c.attributes[semconv.RESPONSE_TOKEN_IDS]) for c in calls]
    # the calls whose prompt extends the previous call's prompt and response form one trajectory; the
    # random model may write a special token (a role marker) that its answer's text cannot carry back
    # into the next prompt, and only that may break a chain
    chains: list[list[int]] = []
    for i in range(len(calls)):
        before = prompts[i - 1] + responses[i - 1] if i else []
        if i and prompts[i][: len(before)] == before:
            chains[-1].append(i)
            continue
        if i:
            text = tokenizer.decode(responses[i - 1])
            assert text != tokenizer.decode(responses[i - 1], skip_special_tokens=True), f"chain broken after {text!r}"
        chains.append([i])
    joined = [c for c in chains if len(c) > 1]
    assert joined, "no two calls of the conversation joined"
    trajectories = sorted((s for s in samples if s.shape == "trajectory"), key=lambda s: s.turn_index)
    assert [(t.turn_index, t.num_turns) for t in trajectories] == [(c[0], len(c)) for c in joined]
    for trajectory, chain in zip(trajectories, joined, strict=True):
        ids, mask = tokens.ids(trajectory.response_token_ids), tokens.mask(trajectory.response_mask)
        assert tokens.ids(trajectory.prompt_token_ids) == prompts[chain[0]]
        assert tokens.ids(trajectory.prompt_token_ids) + ids == prompts[chain[-1]] + responses[chain[-1]]
        expected_mask: list[int] = []
        for j, i in enumerate(chain):  # what the environment added between calls is masked out
            added = len(prompts[i]) - (len(prompts[i - 1]) + len(responses[i - 1])) if j else 0
            expected_mask += [0] * added + [1] * len(responses[i])
        assert mask == expected_mask
        assert [t for t, m in zip(ids, mask, strict=True) if m] == [t for i in chain for t in responses[i]]
