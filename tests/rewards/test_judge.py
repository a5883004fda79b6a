"""judge: one call scores a group of trajectories; a malformed answer is sent back once, then an
error; the judge's calls go out as the attempt's and marked, so the proxy stores them with the
rollout and the adapter never samples them."""

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


async def test_the_agents_llm_is_judged_attributed_and_marked(fake_server: FakeOpenAI) -> None:
    """Given the agent's LLM, the judge calls its server as the attempt (path and headers), with the
    judge's mark and the LLM's model and key."""
    llm = llm_for_attempt({"model": "policy"}, f"{fake_server.base_url}/v1", "r-1", "a-1", api_key="proxy-key")
    fake_server.script(scores((1.0, "right"), (0.0, "wrong")))
    verdicts = await judge(GROUP, client=llm)
    assert [float(v) for v in verdicts] == [1.0, 0.0]
    request = fake_server.requests[-1]
    assert request.path == "/rollout/r-1/attempt/a-1/v1/chat/completions" and request.body["model"] == "policy"
    headers = {k.lower(): v for k, v in request.headers.items()}
    assert headers[JUDGE_HEADER] == JUDGE_PURPOSE and headers["authorization"] == "Bearer proxy-key"
    assert (headers[semconv.HEADER_ROLLOUT_ID], headers[semconv.HEADER_ATTEMPT_ID]) == ("r-1", "a-1")


async def test_an_openai_client_keeps_its_headers_and_gets_the_mark(fake_server: FakeOpenAI) -> None:
    """The agent's ready-made async_client is copied with its attribution and the judge's mark added."""
    llm = llm_for_attempt({"model": "policy"}, f"{fake_server.base_url}/v1", "r-2", "a-2")
    fake_server.script(scores((0.5, "same"), (0.5, "same")))
    await judge(GROUP, client=llm.async_client, model="policy")
    request = fake_server.requests[-1]
    headers = {k.lower(): v for k, v in request.headers.items()}
    assert request.path == "/rollout/r-2/attempt/a-2/v1/chat/completions"
    assert headers[JUDGE_HEADER] == JUDGE_PURPOSE and headers[semconv.HEADER_ROLLOUT_ID] == "r-2"
    assert JUDGE_HEADER not in llm.async_client._custom_headers  # the agent's own client is left unmarked


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


async def test_the_proxy_stores_the_judges_call_marked_and_the_adapter_skips_it(
    vllm_proxy: tuple[RunningProxy, FakeOpenAI, str], redis_url: str
) -> None:
    """Through a real proxy: the agent's call and the judge's are both stored with the attempt, the
    judge's with its purpose; the adapter samples the agent's alone and counts the judge's."""
    from fulmen_adapter.triplets import SKIPPED_JUDGE_CALLS, AttemptInfo, sample_fields

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
    spans = await store.spans.query_spans(rollout_id)
    calls = [s for s in spans if s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL]
    purposes = [s.attributes.get(semconv.CALL_PURPOSE) for s in calls]
    assert purposes == [None, JUDGE_PURPOSE]
    assert "You judge attempts" in calls[1].attributes[semconv.REQUEST_JSON]
    stats: dict[str, int] = {}
    fields = sample_fields(spans, AttemptInfo(rollout_id, attempt_id, "g", reward=1.0), stats=stats)
    assert [f["sample_id"] for f in fields] == [f"{attempt_id}/t0"]
    assert "You judge" not in fields[0]["request_json"] and stats == {SKIPPED_JUDGE_CALLS: 1}
    await client.aclose()
