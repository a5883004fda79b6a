"""The proxy with the torch backend, called with the official openai client (sync and async, streaming
and not): token ids, log-probabilities, spans, attribution, model version."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import httpx
import openai
import pytest
import torch
from proxy_helpers import RunningProxy

from fulmen import tokens
from fulmen.demo.tiny_model import load_tiny_model
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.telemetry.tracing import rollout_trace_id

MESSAGES = [{"role": "user", "content": "12+7="}]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> tuple[torch.nn.Module, object]:
    return load_tiny_model(tiny_model)


def forward_logprobs(model: torch.nn.Module, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """Log-probabilities of ``token_ids`` after ``prompt_ids`` from one plain forward pass."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    n = len(prompt_ids)
    return [logprobs[n - 1 + i, t].item() for i, t in enumerate(token_ids)]


def decode(tokenizer: object, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]


async def test_sync_chat_returns_faithful_tokens_and_stores_span_first(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], reference: tuple
) -> None:
    """Sync chat: token ids decode to the text, logprobs match a forward pass, span stored before the reply."""
    model, tokenizer = reference
    client = openai.OpenAI(base_url=torch_proxy.base(*attempt), api_key="unused")
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    extra = response.model_extra or {}
    prompt_ids, token_ids = extra["prompt_token_ids"], response.choices[0].model_extra["token_ids"]
    assert decode(tokenizer, token_ids) == response.choices[0].message.content
    expected_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt_ids == tokenizer.encode(expected_prompt, add_special_tokens=False)
    logprobs = [c.logprob for c in response.choices[0].logprobs.content]
    assert logprobs == pytest.approx(forward_logprobs(model, prompt_ids, token_ids), abs=1e-4)
    assert extra["model_version"] == "base"
    # No wait: the span was stored before the response was sent.
    spans = await proxy_store.spans.query_spans(attempt[0])
    assert len(spans) == 1
    span = spans[0]
    a = span.attributes
    assert (span.rollout_id, span.attempt_id) == attempt
    assert (a[semconv.ROLLOUT_ID], a[semconv.ATTEMPT_ID]) == attempt
    assert span.name == "chat tiny"
    assert tokens.ids(a[semconv.PROMPT_TOKEN_IDS]) == prompt_ids and tokens.ids(a[semconv.RESPONSE_TOKEN_IDS]) == token_ids
    assert tokens.floats(a[semconv.RESPONSE_LOGPROBS]) == pytest.approx(logprobs, abs=1e-6)
    assert a[semconv.MODEL_VERSION] == "base" and a[semconv.TOKEN_FIDELITY] == "exact"
    assert a[semconv.GEN_AI_SYSTEM] == "torch" and a[semconv.GEN_AI_OPERATION] == "chat"
    assert a[semconv.GEN_AI_TEMPERATURE] == 0.0 and a[semconv.GEN_AI_MAX_TOKENS] == 12
    assert a[semconv.GEN_AI_INPUT_TOKENS] == len(prompt_ids) and a[semconv.GEN_AI_OUTPUT_TOKENS] == len(
        token_ids
    )
    assert a[semconv.LATENCY_MS] > 0 and a[semconv.STREAM] is False
    assert span.trace_id == f"{rollout_trace_id(attempt[0]):032x}"


async def test_async_streaming_chat_carries_ids_in_chunks(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], reference: tuple
) -> None:
    """Async streaming chat: prompt ids in the first chunk, token ids and logprobs per chunk, span stored."""
    model, tokenizer = reference
    client = openai.AsyncOpenAI(base_url=torch_proxy.base(*attempt), api_key="unused")
    stream = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=0.8, seed=3, stream=True
    )
    chunks = [chunk async for chunk in stream]
    await client.close()
    prompt_ids = chunks[0].model_extra["prompt_token_ids"]
    token_ids = [t for c in chunks for choice in c.choices for t in choice.model_extra["token_ids"]]
    logprobs = [
        x.logprob for c in chunks for choice in c.choices if choice.logprobs for x in choice.logprobs.content
    ]
    text = "".join(choice.delta.content or "" for c in chunks for choice in c.choices)
    assert decode(tokenizer, token_ids) == text
    assert logprobs == pytest.approx(forward_logprobs(model, prompt_ids, token_ids), abs=1e-4)
    assert all(c.model_extra["model_version"] == "base" for c in chunks)
    spans = await proxy_store.spans.query_spans(attempt[0])
    assert [tokens.ids(s.attributes[semconv.RESPONSE_TOKEN_IDS]) for s in spans] == [token_ids]
    assert spans[0].attributes[semconv.STREAM] is True
    assert spans[0].attributes[semconv.GEN_AI_SEED] == 3


async def test_sync_streaming_completion_and_async_completion_of_token_ids(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], reference: tuple
) -> None:
    """Text completions, streaming (sync) and from token ids (async): ids, logprobs and spans agree."""
    model, tokenizer = reference
    client = openai.OpenAI(base_url=torch_proxy.base(*attempt), api_key="unused")
    chunks = list(
        client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, stream=True)
    )
    prompt_ids = chunks[0].choices[0].model_extra["prompt_token_ids"]
    assert prompt_ids == tokenizer.encode("hello")
    token_ids = [t for c in chunks for ch in c.choices for t in ch.model_extra["token_ids"]]
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert decode(tokenizer, token_ids) == text
    logprobs = [x for c in chunks for ch in c.choices if ch.logprobs for x in ch.logprobs.token_logprobs]
    assert logprobs == pytest.approx(forward_logprobs(model, prompt_ids, token_ids), abs=1e-4)

    aclient = openai.AsyncOpenAI(base_url=torch_proxy.base(*attempt), api_key="unused")
    response = await aclient.completions.create(model="tiny", prompt=prompt_ids, max_tokens=8, temperature=0)
    await aclient.close()
    choice = response.choices[0]
    assert choice.model_extra["prompt_token_ids"] == prompt_ids
    assert choice.model_extra["token_ids"] == token_ids  # greedy: the same continuation
    assert choice.text == text
    assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-5)
    spans = await proxy_store.spans.query_spans(attempt[0])
    assert [s.name for s in spans] == ["text_completion tiny"] * 2


async def test_headers_attribute_and_traceparent_joins_the_trace(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    """Attribution by x-fulmen-* headers; the span's trace and parent come from traceparent."""
    rollout_id, attempt_id = attempt
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    client = openai.OpenAI(
        base_url=torch_proxy.base(),
        api_key="unused",
        default_headers={
            semconv.HEADER_ROLLOUT_ID: rollout_id,
            semconv.HEADER_ATTEMPT_ID: attempt_id,
            "traceparent": f"00-{trace_id}-{parent_id}-01",
        },
    )
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    (span,) = await proxy_store.spans.query_spans(rollout_id)
    assert (span.attempt_id, span.trace_id, span.parent_id) == (attempt_id, trace_id, parent_id)


async def test_unattributed_call_is_served_and_counted(torch_proxy: RunningProxy) -> None:
    """A call with no attempt is served with token ids; it is counted, not stored."""
    client = openai.OpenAI(base_url=torch_proxy.base(), api_key="unused")
    before = _metric(torch_proxy, "fulmen_proxy_unattributed_requests_total")
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=4)
    response = raw.parse()
    assert raw.headers[semconv.HEADER_MODEL_VERSION] == "base"
    assert response.choices[0].model_extra["token_ids"]
    assert _metric(torch_proxy, "fulmen_proxy_unattributed_requests_total") == before + 1


async def test_stop_string_cuts_text_and_keeps_tokens(
    torch_proxy: RunningProxy, attempt: tuple[str, str], reference: tuple
) -> None:
    """A stop string ends generation: the text stops before it, token ids keep what was generated."""
    _, tokenizer = reference
    client = openai.OpenAI(base_url=torch_proxy.base(*attempt), api_key="unused")
    free = client.completions.create(model="tiny", prompt="ab", max_tokens=12, temperature=0).choices[0]
    stop = free.text[3:5]
    assert len(stop) == 2
    for stream in (False, True):
        response = client.completions.create(
            model="tiny", prompt="ab", max_tokens=12, temperature=0, stop=[stop], stream=stream
        )
        choices = [c for chunk in response for c in chunk.choices] if stream else response.choices
        text = "".join(c.text for c in choices)
        ids = [t for c in choices for t in c.model_extra["token_ids"]]
        assert text == free.text[: free.text.index(stop)]
        assert decode(tokenizer, ids).startswith(text + stop)
        assert choices[-1].finish_reason == "stop"


def test_models_health_ready_and_registry(torch_proxy: RunningProxy) -> None:
    """/v1/models lists the model and its version; /healthz and /readyz answer 200."""
    models = openai.OpenAI(base_url=torch_proxy.base(), api_key="unused").models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{torch_proxy.url}/healthz").status_code == 200
    assert httpx.get(f"{torch_proxy.url}/readyz").json() == {"ready": True}


async def test_proxy_registers_its_base_url(torch_proxy: RunningProxy, proxy_store: RedisStore) -> None:
    """The proxy is in the store's registry with its base URL, model and version."""
    (endpoint,) = await proxy_store.registry.query_proxies()
    assert endpoint.base_url == torch_proxy.url
    assert (endpoint.model, endpoint.model_version) == ("tiny", "base")
    assert endpoint.metadata["state"] == "serving"


def _metric(proxy: RunningProxy, name: str) -> float:
    text = urllib.request.urlopen(f"{proxy.url}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
