"""``n > 1`` on the torch backend: one call, n samples, n choices, each recorded as a span of its own
with its token ids, so the adapter gets every sample."""

from __future__ import annotations

import httpx
import openai
import pytest
from proxy_helpers import RunningProxy

from fulmen import tokens
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen_adapter.triplets import AdapterConfig, find_llm_calls, repaired_parents

MESSAGES = [{"role": "user", "content": "12+7="}]


def by_choice(spans: list) -> list:
    return sorted(spans, key=lambda s: s.attributes.get(semconv.CHOICE_INDEX, 0))


async def test_n_samples_are_n_choices_and_n_spans_the_adapter_reads(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    client = openai.OpenAI(base_url=torch_proxy.base(*attempt), api_key="unused", max_retries=0)
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=3, temperature=1.0, seed=7, max_tokens=12
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in response.choices]
    assert len({tuple(i) for i in ids}) > 1  # three samples, not one repeated (seeds 7, 8, 9)
    tokenizer = torch_proxy.app.service.backend.engine.tokenizer
    for choice, choice_ids in zip(response.choices, ids, strict=True):
        assert tokenizer.decode(choice_ids, skip_special_tokens=True) == choice.message.content
        assert len(choice.logprobs.content) == len(choice_ids)
    assert response.usage.completion_tokens == sum(len(i) for i in ids)
    assert response.usage.prompt_tokens == len(response.model_extra["prompt_token_ids"])
    spans = by_choice(await proxy_store.spans.query_spans(attempt[0]))
    assert [tokens.ids(s.attributes[semconv.RESPONSE_TOKEN_IDS]) for s in spans] == ids
    assert [s.attributes.get(semconv.CHOICE_INDEX) for s in spans] == [0, 1, 2]
    assert all(tokens.ids(s.attributes[semconv.PROMPT_TOKEN_IDS]) == response.model_extra["prompt_token_ids"]
               for s in spans)  # fmt: skip
    calls = find_llm_calls(spans, repaired_parents(spans), AdapterConfig())
    assert sorted(tokens.ids(c.response) for c in calls) == sorted(ids)  # every sample reaches the adapter


async def test_streaming_n_interleaves_choices_by_index(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    client = openai.AsyncOpenAI(base_url=torch_proxy.base(*attempt), api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=2, temperature=1.0, seed=3, max_tokens=10, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts, ids, finishes = ["", ""], [[], []], [None, None]
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            ids[choice.index] += choice.model_extra["token_ids"]
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    spans = by_choice(await proxy_store.spans.query_spans(attempt[0]))
    assert [tokens.ids(s.attributes[semconv.RESPONSE_TOKEN_IDS]) for s in spans] == ids
    tokenizer = torch_proxy.app.service.backend.engine.tokenizer
    assert [tokenizer.decode(i, skip_special_tokens=True) for i in ids] == texts
    assert all(f in ("stop", "length") for f in finishes)
    assert usage is not None and usage.completion_tokens == len(ids[0]) + len(ids[1])


async def test_a_retried_n_call_is_answered_from_its_spans(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "n": 2, "temperature": 1.0, "max_tokens": 8}
    url = torch_proxy.base(*attempt) + "/chat/completions"
    async with httpx.AsyncClient(timeout=30) as http:
        first = await http.post(url, json=body, headers={"idempotency-key": "k-1", "x-stainless-retry-count": "0"})
        again = await http.post(url, json=body, headers={"idempotency-key": "k-1", "x-stainless-retry-count": "1"})
    assert first.status_code == again.status_code == 200
    token_ids = [[c["token_ids"] for c in r.json()["choices"]] for r in (first, again)]
    assert token_ids[0] == token_ids[1] and len(token_ids[0]) == 2  # the same two samples, not new ones
    assert len(await proxy_store.spans.query_spans(attempt[0])) == 2


@pytest.mark.parametrize("n", [0, 17, 1.5, True])
def test_n_outside_1_to_16_is_a_400(torch_proxy: RunningProxy, n: object) -> None:
    client = openai.OpenAI(base_url=torch_proxy.base(), api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="n must be an integer"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, n=n)  # type: ignore[arg-type]


async def test_text_completions_take_n_too(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    client = openai.OpenAI(base_url=torch_proxy.base(*attempt), api_key="unused", max_retries=0)
    response = client.completions.create(model="tiny", prompt="12+", n=2, temperature=1.0, seed=1, max_tokens=6)
    assert [c.index for c in response.choices] == [0, 1]
    tokenizer = torch_proxy.app.service.backend.engine.tokenizer
    spans = by_choice(await proxy_store.spans.query_spans(attempt[0]))
    for choice, span in zip(response.choices, spans, strict=True):
        ids = tokens.ids(span.attributes[semconv.RESPONSE_TOKEN_IDS])
        assert choice.model_extra["token_ids"] == ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == choice.text


async def test_the_vllm_backend_refuses_a_streamed_n_rather_than_record_one_choice_of_n() -> None:
    """Not streamed, n > 1 on vLLM is one answer of n choices, each a sample (tests/vllm_sync/test_real_vllm.py);
    streamed, its choices' chunks are not told apart: refused before anything is sent."""
    from fulmen_llm_proxy.backends.base import Call, Result
    from fulmen_llm_proxy.backends.upstream.vllm import VllmBackend
    from fulmen_llm_proxy.errors import ProxyError

    backend = VllmBackend(["http://127.0.0.1:1"])  # never reached: refused before sending
    call = Call(operation="chat", body={"messages": MESSAGES, "n": 2, "stream": True}, model="m", stream=True,
                max_tokens=4, temperature=1.0, top_p=1.0, seed=None, stop=[], n=2)  # fmt: skip
    with pytest.raises(ProxyError) as caught:
        async for _ in backend.stream(call, Result()):
            pass
    assert caught.value.status == 400 and caught.value.param == "n"
    await backend.close()
