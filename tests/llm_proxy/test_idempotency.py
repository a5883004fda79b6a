"""A client's retry of a recorded call is the same call: stored once, answered from the record."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from proxy_helpers import RunningProxy

from fulmen.records import Span
from fulmen.sdk.resources import llm_for_attempt
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen_adapter.triplets import AttemptInfo, spans_to_samples
from fulmen_llm_proxy.app import ProxyApp

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def lose_first_response(torch_proxy: RunningProxy) -> Iterator[list[str]]:
    """The proxy records the first call's span, then fails before answering (as a proxy killed
    between its span write and its response would): the client sees a 500 and retries."""
    app: ProxyApp = torch_proxy.app
    original = app._record
    lost: list[str] = []

    async def record_then_fail(*args: Any, **kwargs: Any) -> None:
        await original(*args, **kwargs)
        if not lost:
            lost.append("lost")
            raise RuntimeError("response lost after the span was stored")

    app._record = record_then_fail  # type: ignore[method-assign]
    yield lost
    del app._record


async def _llm_spans(store: RedisStore, rollout_id: str, attempt_id: str) -> list[Span]:
    spans = await store.spans.query_spans(rollout_id, attempt_id)
    return [s for s in spans if s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL]


@pytest.mark.parametrize("sync", [False, True])
async def test_retry_after_a_lost_response_is_one_call(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str],
    lose_first_response: list[str], sync: bool,
) -> None:  # fmt: skip
    """Recorded, response lost, client retries: one span, the recorded answer, one sample."""
    rollout_id, attempt_id = attempt
    llm = llm_for_attempt({"model": "tiny"}, torch_proxy.url, rollout_id, attempt_id)
    # the SDK's clients: they send an idempotency key and retry (max_retries=2)
    if sync:
        create = llm.client.chat.completions.create
        response = await asyncio.to_thread(create, model="tiny", messages=MESSAGES, max_tokens=8)
    else:
        response = await llm.async_client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8
        )
    text = response.choices[0].message.content
    assert lose_first_response == ["lost"]  # the first try's response was lost indeed
    (span,) = await _llm_spans(proxy_store, rollout_id, attempt_id)
    assert json.loads(span.attributes[semconv.RESPONSE_JSON])["content"] == text
    assert span.attributes[semconv.CALL_KEY]
    info = AttemptInfo(rollout_id, attempt_id, "g", mode="train", group_size=1, reward=1.0)
    assert len(spans_to_samples(await proxy_store.spans.query_spans(rollout_id, attempt_id), info)) == 1


async def test_each_logical_call_is_recorded(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    """Two calls with the same body are two calls: each has its own key, each is recorded."""
    rollout_id, attempt_id = attempt
    client = llm_for_attempt({"model": "tiny"}, torch_proxy.url, rollout_id, attempt_id).async_client
    for _ in range(2):
        await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    spans = await _llm_spans(proxy_store, rollout_id, attempt_id)
    assert len(spans) == 2
    assert len({s.attributes[semconv.CALL_KEY] for s in spans}) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_a_retry_is_answered_from_the_record(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], stream: bool
) -> None:
    """A second request with the same idempotency key (a retry) gets the recorded response, streamed
    or not, and stores nothing more; a first try (retry count 0) is served and recorded."""
    rollout_id, attempt_id = attempt
    url = f"{torch_proxy.base(rollout_id, attempt_id)}/chat/completions"
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0}
    key = {semconv.HEADER_IDEMPOTENCY_KEY: f"key-{stream}"}
    async with httpx.AsyncClient() as http:
        first = await http.post(url, json=body, headers={**key, "x-stainless-retry-count": "0"})
        assert first.status_code == 200
        retry = await http.post(
            url, json={**body, "stream": stream}, headers={**key, "x-stainless-retry-count": "1"}
        )
        assert retry.status_code == 200
    (span,) = await _llm_spans(proxy_store, rollout_id, attempt_id)
    recorded = json.loads(span.attributes[semconv.RESPONSE_JSON])["content"]
    assert first.json()["choices"][0]["message"]["content"] == recorded
    if stream:
        events = [line[6:] for line in retry.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == recorded
    else:
        assert retry.json()["choices"][0]["message"]["content"] == recorded
        assert retry.json()["choices"][0]["token_ids"] == first.json()["choices"][0]["token_ids"]
        assert retry.headers[semconv.HEADER_MODEL_VERSION] == first.headers[semconv.HEADER_MODEL_VERSION]


async def test_a_malformed_idempotency_key_is_400(
    torch_proxy: RunningProxy, attempt: tuple[str, str]
) -> None:
    """An idempotency key that is not 1-255 visible ASCII characters: 400."""
    url = f"{torch_proxy.base(*attempt)}/chat/completions"
    async with httpx.AsyncClient() as http:
        response = await http.post(url, json={"model": "tiny", "messages": MESSAGES},
                                   headers={semconv.HEADER_IDEMPOTENCY_KEY: "x" * 300})  # fmt: skip
    assert response.status_code == 400
