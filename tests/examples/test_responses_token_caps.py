"""The OpenAI Agents SDK's Responses-API agent (examples/openai_agents) with every default — the tiny
model as built by default, the proxy's torch backend with its default settings, the policy naming no
sampling parameters — meets no hidden token cap: every rollout succeeds, no answer is cut by the
model's context, and an answer cut by max tokens is cut at the limit the agent asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
from proxy_helpers import RunningProxy
from runner_processes import FulmenProcesses, child_env, wait_until_ready

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore
from fulmen.telemetry import semconv

pytestmark = pytest.mark.slow

ROLLOUTS = 6
QUESTION = {"question": "What is 17 * 23?", "answer": 391}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model exactly as `build_tiny_model` builds it by default: its context is under test."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


async def test_responses_agent_with_the_defaults_meets_no_hidden_token_cap(
    torch_proxy: RunningProxy, proxy_store: RedisStore, procs: FulmenProcesses
) -> None:
    """Every rollout of the Responses-API agent succeeds; each cut answer says it was cut by the max
    tokens the agent sent, none by the context length."""
    pytest.importorskip("agents", reason="agents is not installed: pip install -e '.[dev]' (the frameworks extra)")
    assert torch_proxy.settings.default_max_tokens == 256  # the documented default, not a test's choice
    await proxy_store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny"}})  # no sampling parameters
    env = child_env(procs.redis_url, procs.experiment, FULMEN_LLM_BASE_URL=torch_proxy.base())
    runner = await procs.runner("examples.openai_agents.agent:agent", "--concurrency", "2", env=env)
    await wait_until_ready(proxy_store, runner)
    queued = [await proxy_store.rollouts.enqueue_rollout({**QUESTION, "attempt": i}) for i in range(ROLLOUTS)]
    rollouts = await proxy_store.finished.wait_for_rollouts([q.rollout_id for q in queued], timeout_s=600)
    assert [r.status for r in rollouts] == [RolloutStatus.SUCCEEDED] * ROLLOUTS, runner.stderr[-6000:]
    for rollout in rollouts:
        calls = [s.attributes for s in await proxy_store.spans.query_spans(rollout.rollout_id)
                 if s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL]
        assert calls, f"rollout {rollout.rollout_id} recorded no LLM call"
        for call in calls:
            if call.get(semconv.GEN_AI_FINISH_REASONS) != ["length"]:
                assert semconv.TRUNCATED_BY not in call
                continue
            # cut where the agent asked, never earlier by a limit it did not set
            assert call[semconv.TRUNCATED_BY] == "max_tokens", call.get(semconv.GEN_AI_INPUT_TOKENS)
            assert call[semconv.GEN_AI_OUTPUT_TOKENS] == call[semconv.GEN_AI_MAX_TOKENS]
