"""When the model does call the tool, each framework example runs `calculator` and scores the answer
the model gives after the tool result. The model here is a scripted OpenAI-compatible upstream behind
the proxy (openai backend: the tiny model would not call a tool), so the frameworks' own tool plumbing
is what is tested: the Messages and Responses calls are translated by the proxy into the chat calls
the upstream sees, and the tool result goes back to it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fakes.fake_openai import FakeOpenAI
from proxy_helpers import RunningProxy
from runner_processes import FulmenProcesses

from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.telemetry import semconv

pytestmark = pytest.mark.slow

QUESTION = {"question": "What is 17 * 23?", "answer": 391}
CALCULATOR_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": json.dumps({"expression": "17 * 23"})},
}
EXAMPLES = [  # (agent, the module its framework needs)
    ("examples.langgraph.agent:agent", "langgraph"),
    ("examples.openai_agents.agent:agent", "agents"),
    ("examples.openai_agents.agent:chat_agent", "agents"),
    ("examples.autogen.agent:agent", "autogen_agentchat"),
    ("examples.anthropic.agent:agent", "anthropic"),
]


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    fake.start_in_thread()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def upstream_proxy(redis_server: EmbeddedRedis, module_experiment: str, upstream: FakeOpenAI) -> Iterator[RunningProxy]:
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=module_experiment, proxy_backend="openai",
        upstream_urls=upstream.base_url, model_name=upstream.model,
    )  # fmt: skip
    yield proxy
    proxy.stop()


@pytest.mark.parametrize(("agent", "needs"), EXAMPLES, ids=[a.split(".")[1] + ":" + a.split(":")[1] for a, _ in EXAMPLES])
async def test_the_example_runs_the_tool_the_model_calls(
    upstream: FakeOpenAI, upstream_proxy: RunningProxy, proxy_store: RedisStore, procs: FulmenProcesses,
    agent: str, needs: str,
) -> None:
    """Model: a calculator call, then "391"; the example runs the tool, sends "391" back as the tool's
    result, and the rollout ends with reward 1.0 and the tool call recorded as a span."""
    pytest.importorskip(needs, reason=f"{needs} is not installed: pip install -e '.[dev]' (the frameworks extra)")
    upstream.requests.clear()
    upstream.script({"tool_calls": [CALCULATOR_CALL]}, "391")
    await proxy_store.resources.add_resources({"llm": {"kind": "llm", "model": upstream.model, "sampling_parameters": {"temperature": 0.0}}})
    done = await procs.start(
        "run-once", "--agent", agent, "--task", json.dumps(QUESTION), "--llm-base-url", upstream_proxy.base(), "--json"
    )
    assert await done.wait(timeout_s=180) == 0, done.stderr[-6000:]
    result = json.loads(done.stdout)
    assert (result["status"], result["reward"]) == ("succeeded", 1.0)
    rollout = await proxy_store.rollouts.get_rollout(result["rollout_id"])
    assert rollout is not None and rollout.status is RolloutStatus.SUCCEEDED and rollout.reward == 1.0

    first, second, *_ = upstream.requests
    assert first.body["tools"][0]["function"]["name"] == "calculator"
    tool_results = [m for m in second.body["messages"] if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_results] == [("call_1", "391")]
    spans = await proxy_store.spans.query_spans(rollout.rollout_id)
    (tool,) = [s for s in spans if s.name == "calculator" and semconv.OPERATION_INPUT in s.attributes]
    assert json.loads(tool.attributes[semconv.OPERATION_INPUT])["kwargs"] == {"expression": "17 * 23"}
    assert tool.attributes[semconv.OPERATION_OUTPUT] == '"391"'
