"""judge: one call scores a group of trajectories; a malformed answer is sent back once, then an
error; the judge's calls go out unattributed and marked, so the proxy stores none of them."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from fakes.fake_openai import FakeOpenAI

from fulmen.rewards import JudgeError, judge
from fulmen.rewards.judging import JUDGE_HEADER, JUDGE_PURPOSE
from fulmen.sdk.resources import llm_for_attempt
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.telemetry import semconv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llm_proxy"))
from proxy_helpers import RunningProxy

QUESTION = {"role": "user", "content": "What is 17 * 23?"}
GROUP = [[QUESTION, {"role": "assistant", "content": "391"}], [QUESTION, {"role": "assistant", "content": "400"}]]


def scores(*pairs: tuple[float, str]) -> str:
    return json.dumps({"scores": [{"trajectory": i, "score": s, "reason": r} for i, (s, r) in enumerate(pairs, 1)]})


class StubClient:
    """An AsyncOpenAI stand-in: scripted answers, every request kept."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.requests: list[dict[str, Any]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))
        self.base_url = "http://judge.example/v1"
        self._custom_headers: dict[str, str] = {}

    async def _create(self, **request: Any) -> Any:
        self.requests.append(request)
        message = SimpleNamespace(content=self.answers.pop(0))
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])

    def copy(self, **_: Any) -> StubClient:
        return self


async def test_one_call_scores_the_group_in_order() -> None:
    """All trajectories go in one numbered prompt, the shared question once; scores come back in order."""
    client = StubClient("```json\n" + scores((0.9, "right"), (0.1, "wrong")) + "\n```")
    verdicts = await judge(GROUP, client=client, model="judge-model", rubric="Correct answers win.")
    assert [float(v) for v in verdicts] == [0.9, 0.1] and verdicts[0].reason == "right"
    (request,) = client.requests
    system, user = request["messages"]
    assert request["model"] == "judge-model" and "Correct answers win." in system["content"]
    assert user["content"].count("What is 17 * 23?") == 1
    assert user["content"].index("# Trajectory 1\n[assistant] 391") < user["content"].index("# Trajectory 2\n[assistant] 400")


async def test_a_malformed_answer_is_sent_back_once_then_fails() -> None:
    """A missing score is named back to the judge; its corrected answer is used; two bad ones raise."""
    client = StubClient(scores((0.9, "right")), scores((0.8, "right"), (0.2, "wrong")))
    verdicts = await judge(GROUP, client=client, model="m")
    assert [float(v) for v in verdicts] == [0.8, 0.2]
    retry = client.requests[1]["messages"]
    assert retry[-1]["role"] == "user" and "no score for trajectory 2" in retry[-1]["content"]
    bad = StubClient("I think the first is better.", scores((1.5, "x"), (0.0, "y")))
    with pytest.raises(JudgeError, match=r"no JSON object.*not between 0 and 1"):
        await judge(GROUP, client=bad, model="m")
    assert await judge([], client=StubClient(), model="m") == []


@pytest.fixture
def fake_server() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    fake.start_in_thread()
    yield fake
    fake.stop()


async def test_the_agents_llm_is_judged_unattributed_and_marked(fake_server: FakeOpenAI) -> None:
    """Given the agent's LLM, the judge calls its server without the attempt's path or headers,
    with the judge's mark and the LLM's model and key."""
    llm = llm_for_attempt({"model": "policy"}, f"{fake_server.base_url}/v1", "r-1", "a-1", api_key="proxy-key")
    assert "/rollout/r-1/attempt/a-1" in llm.base_url
    fake_server.script(scores((1.0, "right"), (0.0, "wrong")))
    verdicts = await judge(GROUP, client=llm)
    assert [float(v) for v in verdicts] == [1.0, 0.0]
    request = fake_server.requests[-1]
    assert request.path == "/v1/chat/completions" and request.body["model"] == "policy"
    headers = {k.lower(): v for k, v in request.headers.items()}
    assert headers[JUDGE_HEADER] == JUDGE_PURPOSE and headers["authorization"] == "Bearer proxy-key"
    assert semconv.HEADER_ROLLOUT_ID not in headers and semconv.HEADER_ATTEMPT_ID not in headers


async def test_an_attributed_openai_client_is_unattributed(fake_server: FakeOpenAI) -> None:
    """The agent's ready-made async_client (attributed by path and headers) is copied without both."""
    llm = llm_for_attempt({"model": "policy"}, f"{fake_server.base_url}/v1", "r-2", "a-2")
    fake_server.script(scores((0.5, "same"), (0.5, "same")))
    await judge(GROUP, client=llm.async_client, model="policy")
    request = fake_server.requests[-1]
    headers = {k.lower() for k in request.headers}
    assert request.path == "/v1/chat/completions" and JUDGE_HEADER in headers
    assert semconv.HEADER_ROLLOUT_ID not in headers


@pytest.fixture
def vllm_proxy(redis_server: EmbeddedRedis) -> Iterator[tuple[RunningProxy, FakeOpenAI, str]]:
    """A proxy on the vllm backend (token ids: its calls are trainable) in front of a fake vLLM."""
    fake = FakeOpenAI(vllm=True)
    fake.start_in_thread()
    experiment = f"judge-{uuid.uuid4().hex[:8]}"
    proxy = RunningProxy(redis_url=redis_server.url, experiment=experiment, proxy_backend="vllm",
                         upstream_urls=fake.base_url)
    yield proxy, fake, experiment
    proxy.stop()
    fake.stop()


async def test_the_proxy_stores_the_agents_call_not_the_judges(
    vllm_proxy: tuple[RunningProxy, FakeOpenAI, str], redis_url: str
) -> None:
    """Through a real proxy: the agent's call is stored as its attempt's LLM call (a sample to be),
    the judge's call on the same LLM is served and stored nowhere."""
    proxy, fake, experiment = vllm_proxy
    client = aioredis.from_url(redis_url)
    store = RedisStore(client, experiment)
    started = await store.rollouts.start_rollout({"task": "judge"}, "test-worker")
    rollout_id, attempt_id = started.rollout.rollout_id, started.attempt.attempt_id
    llm = llm_for_attempt({"model": "fake-model"}, f"{proxy.url}/v1", rollout_id, attempt_id)
    async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key) as agent_client:
        await agent_client.chat.completions.create(model=llm.model, messages=[QUESTION], max_tokens=4)
    fake.script(scores((1.0, "right"), (0.0, "wrong")))
    verdicts = await judge(GROUP, client=llm)
    assert [float(v) for v in verdicts] == [1.0, 0.0]
    assert "You judge attempts" in json.dumps(fake.requests[-1].body)  # the judge's call was served
    spans = await store.spans.query_spans(rollout_id)
    calls = [s for s in spans if s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL]
    assert len(calls) == 1 and "You judge" not in calls[0].attributes[semconv.REQUEST_JSON]
    await client.aclose()
