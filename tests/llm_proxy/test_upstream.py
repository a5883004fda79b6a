"""The vllm and openai backends against fake upstream servers on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from fakes.fake_openai import FakeOpenAI, fake_logprobs, token_ids
from proxy_helpers import RunningProxy

from fulmen import tokens
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.telemetry import semconv

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}


@pytest.fixture(scope="module")
def vllm_fakes() -> Iterator[list[FakeOpenAI]]:
    fakes = [FakeOpenAI(vllm=True, name=f"replica-{i}", default_reply="four") for i in range(2)]
    for fake in fakes:
        fake.start_in_thread()
    yield fakes
    for fake in fakes:
        fake.stop()


@pytest.fixture(scope="module")
def vllm_proxy(
    redis_server: EmbeddedRedis, module_experiment: str, vllm_fakes: list[FakeOpenAI]
) -> Iterator[RunningProxy]:
    urls = ",".join(f.base_url + "/v1" for f in vllm_fakes)
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=module_experiment, proxy_backend="vllm", upstream_urls=urls
    )
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def openai_fake() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI(api_key="upstream-key")
    fake.start_in_thread()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def openai_proxy(
    redis_server: EmbeddedRedis, module_experiment: str, openai_fake: FakeOpenAI
) -> Iterator[RunningProxy]:
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=module_experiment, proxy_backend="openai",
        upstream_urls=openai_fake.base_url, upstream_api_key="upstream-key", model_name="fake-model",
        upstream_backoff_s=0.01,
    )  # fmt: skip
    yield proxy
    proxy.stop()


async def test_vllm_chat_returns_and_records_upstream_token_ids(
    vllm_proxy: RunningProxy, vllm_fakes: list[FakeOpenAI], proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    """vllm backend: asks for token ids, passes vLLM's fields through, records them as exact."""
    client = openai.OpenAI(base_url=vllm_proxy.base(*attempt), api_key="unused")
    response = client.chat.completions.create(model="any", messages=MESSAGES)
    prompt_ids = token_ids("Be brief.2+2?")
    assert response.model_extra["prompt_token_ids"] == prompt_ids
    assert response.choices[0].model_extra["token_ids"] == token_ids("four")
    assert [c.logprob for c in response.choices[0].logprobs.content] == fake_logprobs(4)
    sent = [r.body for f in vllm_fakes for r in f.requests][-1]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    (span,) = await proxy_store.spans.query_spans(attempt[0])
    a = span.attributes
    assert a[semconv.GEN_AI_SYSTEM] == "vllm" and a[semconv.TOKEN_FIDELITY] == "exact"
    assert tokens.ids(a[semconv.PROMPT_TOKEN_IDS]) == prompt_ids and tokens.ids(a[semconv.RESPONSE_TOKEN_IDS]) == token_ids("four")
    assert tokens.floats(a[semconv.RESPONSE_LOGPROBS]) == pytest.approx(fake_logprobs(4), abs=1e-6)
    assert a[semconv.GEN_AI_INPUT_TOKENS] == len(prompt_ids)


async def test_vllm_streaming_chat_and_completion(
    vllm_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    """vllm backend streaming: chunks pass through with their ids; the span joins them."""
    client = openai.AsyncOpenAI(base_url=vllm_proxy.base(*attempt), api_key="unused")
    chunks = [
        c async for c in await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    ]
    assert chunks[0].model_extra["prompt_token_ids"] == token_ids("Be brief.2+2?")
    assert [
        t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []
    ] == token_ids("four")
    stream = await client.completions.create(model="m", prompt="2+2=", stream=True)
    chunks = [c async for c in stream]
    await client.close()
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == token_ids("2+2=")
    chat_span, completion_span = await proxy_store.spans.query_spans(attempt[0])
    for span, prompt in ((chat_span, "Be brief.2+2?"), (completion_span, "2+2=")):
        a = span.attributes
        assert tokens.ids(a[semconv.PROMPT_TOKEN_IDS]) == token_ids(prompt)
        assert tokens.ids(a[semconv.RESPONSE_TOKEN_IDS]) == token_ids("four")
        assert tokens.floats(a[semconv.RESPONSE_LOGPROBS]) == pytest.approx(fake_logprobs(4), abs=1e-6)
        assert a[semconv.GEN_AI_OUTPUT_TOKENS] == 4 and a[semconv.TOKEN_FIDELITY] == "exact"


async def test_replicas_are_sticky_by_rollout(
    vllm_proxy: RunningProxy, vllm_fakes: list[FakeOpenAI], proxy_store: RedisStore
) -> None:
    """Every call of a rollout goes to the same replica; rollouts spread over both."""
    served: dict[str, set[str]] = {}
    # Each rollout's replica is a hash of its id and the fakes' (random) ports: with 12 rollouts all
    # landed on one replica once in about 2,000 runs (a clean-clone CI saw it); with 32, once in 2e9.
    for i in range(32):
        started = await proxy_store.rollouts.start_rollout({}, "w", rollout_id=f"sticky-{i}-{proxy_store.experiment}")
        rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
        client = openai.OpenAI(base_url=vllm_proxy.base(rid, aid), api_key="unused")
        for _ in range(3):
            served.setdefault(rid, set()).add(
                client.chat.completions.create(model="m", messages=MESSAGES).system_fingerprint
            )
    assert all(len(replicas) == 1 for replicas in served.values())
    assert set().union(*served.values()) == {"replica-0", "replica-1"}


async def test_openai_backend_is_text_only_and_passes_tool_calls(
    openai_proxy: RunningProxy, openai_fake: FakeOpenAI, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    """openai backend: tool calls pass through (streaming too), the span says text_only, the key goes upstream."""
    openai_fake.script({"tool_calls": [TOOL_CALL]}, {"tool_calls": [TOOL_CALL]}, "plain")
    client = openai.OpenAI(base_url=openai_proxy.base(*attempt), api_key="unused")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    response = client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=tools)
    assert response.choices[0].message.tool_calls[0].function.arguments == TOOL_CALL["function"]["arguments"]
    assert response.choices[0].finish_reason == "tool_calls"
    assert openai_fake.requests[-1].body["tools"] == tools
    assert "return_token_ids" not in openai_fake.requests[-1].body
    chunks = list(
        client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=tools, stream=True)
    )
    assert any(ch.delta.tool_calls for c in chunks for ch in c.choices)
    text = client.chat.completions.create(model="fake-model", messages=MESSAGES).choices[0].message.content
    assert text == "plain"
    spans = await proxy_store.spans.query_spans(attempt[0])
    assert len(spans) == 3
    for span in spans:
        assert span.attributes[semconv.TOKEN_FIDELITY] == "text_only"
        assert semconv.RESPONSE_TOKEN_IDS not in span.attributes
    for span in spans[:2]:
        assert json.loads(span.attributes[semconv.RESPONSE_JSON])["tool_calls"] == [TOOL_CALL]
    assert json.loads(spans[2].attributes[semconv.RESPONSE_JSON])["content"] == "plain"


def test_upstream_errors_map_to_statuses(openai_proxy: RunningProxy, openai_fake: FakeOpenAI) -> None:
    """Upstream 4xx keeps its status and message; upstream 5xx (each of the 3 attempts) is 502; the
    proxy keeps serving."""
    url = f"{openai_proxy.base()}/chat/completions"
    body = {"model": "fake-model", "messages": MESSAGES}
    openai_fake.script({"status": 400, "error": "bad thing"}, *[{"status": 500, "error": "boom"}] * 3)
    first = httpx.post(url, json=body)
    assert first.status_code == 400 and first.json()["error"]["message"] == "bad thing"
    second = httpx.post(url, json=body)
    assert second.status_code == 502 and "boom" in second.json()["error"]["message"]
    assert httpx.post(url, json=body).status_code == 200
    unknown = httpx.post(url, json={**body, "model": "other"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_unreachable_upstream_is_502_and_a_dead_replica_is_skipped(
    redis_server: EmbeddedRedis, experiment: str, openai_fake: FakeOpenAI
) -> None:
    """No upstream listening: 502 upstream_unreachable; with a live replica too, every call is served."""
    body = {"model": "m", "messages": MESSAGES}
    dead = "http://127.0.0.1:9"
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=experiment, proxy_backend="openai", upstream_urls=dead
    )
    try:
        response = httpx.post(f"{proxy.base()}/chat/completions", json=body)
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_unreachable"
    finally:
        proxy.stop()
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=experiment, proxy_backend="openai",
        upstream_urls=f"{dead},{openai_fake.base_url}", upstream_api_key="upstream-key",
    )  # fmt: skip
    try:
        for i in range(6):
            url = f"{proxy.base(f'r{i}', 'a')}/chat/completions"
            assert httpx.post(url, json=body).status_code == 200
    finally:
        proxy.stop()


async def test_a_teachers_text_only_answers_become_retokenized_samples(
    openai_proxy: RunningProxy, openai_fake: FakeOpenAI, proxy_store: RedisStore, attempt: tuple[str, str],
    tiny_model,  # type: ignore[no-untyped-def]
) -> None:
    """Distillation through the proxy: an agent's two-turn conversation answered by a text-only upstream
    (the teacher) is recorded without token ids; the adapter, given the policy's tokenizer, turns it
    into samples tokenised with the policy's chat template, one trajectory masked to the answers."""
    from fulmen.records import Sample
    from fulmen_adapter.retokenize import Retokenizer
    from fulmen_adapter.triplets import AdapterConfig, AttemptInfo, spans_to_samples

    openai_fake.script("four", "five")
    client = openai.OpenAI(base_url=openai_proxy.base(*attempt), api_key="unused")
    first = client.chat.completions.create(model="fake-model", messages=MESSAGES).choices[0].message.content
    follow_up = [*MESSAGES, {"role": "assistant", "content": first}, {"role": "user", "content": "and 2+3?"}]
    client.chat.completions.create(model="fake-model", messages=follow_up)
    spans = await proxy_store.spans.query_spans(attempt[0])
    retokenize = Retokenizer(tiny_model)
    info = AttemptInfo(attempt[0], attempt[1], "task", mode="train", reward=1.0)
    samples = [Sample.from_wire(s.to_wire()) for s in spans_to_samples(spans, info, AdapterConfig(retokenize=retokenize))]
    assert {s.shape for s in samples} == {"triplet", "trajectory"} and all(s.retokenized for s in samples)
    (trajectory,) = [s for s in samples if s.shape == "trajectory"]
    tok = retokenize.tokenizer
    answers = [t for t, m in zip(trajectory.response_token_ids, trajectory.response_mask, strict=True) if m]
    assert tok.decode(answers) == f"four{tok.eos_token}five{tok.eos_token}"
    assert trajectory.prompt_token_ids == retokenize._render(MESSAGES, None, add_generation_prompt=True)
