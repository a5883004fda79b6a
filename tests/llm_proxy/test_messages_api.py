"""The Anthropic Messages API (``POST /v1/messages``) on the proxy, called with the official anthropic
client: on the torch backend (sync and async, ``create`` and ``stream``, each call a recorded chat
span), stop sequences, tool_use / tool_result blocks, tool calls mapped from an OpenAI-compatible
upstream, and 400s in Anthropic's error shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from api_helpers import check_torch_span, llm_spans
from fakes.fake_openai import FakeOpenAI, fake_logprobs, token_ids
from proxy_helpers import RunningProxy

from fulmen import tokens
from fulmen.demo.tiny_model import load_tiny_model
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen_adapter.triplets import AttemptInfo, spans_to_samples

USER = [{"role": "user", "content": "12+7="}]
TOOL = {"name": "add", "description": "Add two numbers",
        "input_schema": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}  # fmt: skip
GREEDY = {"temperature": 0}  # recent anthropic clients take sampling parameters only in extra_body
TOOL_CALL = {"id": "toolu_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 5}'}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return load_tiny_model(tiny_model)[1]


def _base(proxy: RunningProxy, attempt: tuple[str, str] | None = None) -> str:
    """The anthropic client's base URL: it appends /v1/messages itself."""
    return proxy.base(*attempt)[:-3] if attempt else proxy.url


async def _create(base: str, sync: bool, **kwargs: Any) -> Any:
    if sync:
        return anthropic.Anthropic(base_url=base, api_key="unused").messages.create(**kwargs)
    async with anthropic.AsyncAnthropic(base_url=base, api_key="unused") as client:
        return await client.messages.create(**kwargs)


async def _stream(base: str, sync: bool, **kwargs: Any) -> tuple[str, Any]:
    """(the text as streamed, the final message) through the client's ``messages.stream`` helper."""
    if sync:
        with anthropic.Anthropic(base_url=base, api_key="unused").messages.stream(**kwargs) as stream:
            text = "".join(stream.text_stream)
            return text, stream.get_final_message()
    client = anthropic.AsyncAnthropic(base_url=base, api_key="unused")
    async with client, client.messages.stream(**kwargs) as astream:
        text = "".join([t async for t in astream.text_stream])
        return text, await astream.get_final_message()


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_create_on_torch_is_a_recorded_chat_call(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], tokenizer: Any, sync: bool
) -> None:
    """Not streaming: one text block, the model's text, its ids in the body and the span."""
    message = await _create(_base(torch_proxy, attempt), sync, model="tiny", max_tokens=12, extra_body=GREEDY,
                            system=[{"type": "text", "text": "Be brief."}], messages=USER)  # fmt: skip
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert [b.type for b in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert message.usage.output_tokens == len(message.model_extra["token_ids"])
    (span,) = await llm_spans(proxy_store, attempt[0])
    messages = check_torch_span(span, tokenizer, message.content[0].text, "anthropic.messages", stream=False)
    assert messages == [{"role": "system", "content": "Be brief."}, *USER]
    assert tokens.ids(span.attributes[semconv.RESPONSE_TOKEN_IDS]) == message.model_extra["token_ids"]
    assert message.usage.input_tokens == len(tokens.ids(span.attributes[semconv.PROMPT_TOKEN_IDS]))
    assert span.attributes[semconv.GEN_AI_MAX_TOKENS] == 12


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_stream_on_torch_is_a_recorded_chat_call(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], tokenizer: Any, sync: bool
) -> None:
    """The client's ``messages.stream``: the streamed text is the final message's and the span's."""
    text, message = await _stream(_base(torch_proxy, attempt), sync, model="tiny", max_tokens=10,
                                  extra_body=GREEDY, system="Be brief.", messages=USER)  # fmt: skip
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == text
    assert message.stop_reason in ("end_turn", "max_tokens")
    (span,) = await llm_spans(proxy_store, attempt[0])
    check_torch_span(span, tokenizer, text, "anthropic.messages", stream=True)
    n_out = len(tokens.ids(span.attributes[semconv.RESPONSE_TOKEN_IDS]))
    assert message.usage.output_tokens == n_out
    assert message.usage.input_tokens == len(tokens.ids(span.attributes[semconv.PROMPT_TOKEN_IDS]))


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_create_stream_sends_anthropics_events_in_order(
    torch_proxy: RunningProxy, attempt: tuple[str, str], sync: bool
) -> None:
    """``create(stream=True)``: message_start, the text block's start / deltas / stop, message_delta, message_stop."""
    kwargs = {"model": "tiny", "max_tokens": 8, "messages": USER, "stream": True}
    if sync:
        events = list(anthropic.Anthropic(base_url=_base(torch_proxy, attempt), api_key="u").messages.create(**kwargs))
    else:
        async with anthropic.AsyncAnthropic(base_url=_base(torch_proxy, attempt), api_key="u") as client:
            events = [e async for e in await client.messages.create(**kwargs)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    assert events[-2].usage.output_tokens == len(events[-2].model_extra["token_ids"])


async def test_stop_sequence_is_named(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    """A stop sequence that ends the text: cut before it, stop_reason stop_sequence, the sequence named."""
    base = _base(torch_proxy, attempt)
    full = (await _create(base, True, model="tiny", max_tokens=16, extra_body=GREEDY, messages=USER)).content[0].text
    cut = next(i for i in range(1, len(full)) if full[i] not in full[:i])  # its first occurrence
    for sync in (True, False):
        message = await _create(base, sync, model="tiny", max_tokens=16, extra_body=GREEDY, messages=USER,
                                stop_sequences=["never-seen", full[cut]])  # fmt: skip
        assert message.content[0].text == full[:cut]
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", full[cut])
    _, streamed = await _stream(base, True, model="tiny", max_tokens=16, extra_body=GREEDY, messages=USER,
                                stop_sequences=[full[cut]])  # fmt: skip
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", full[cut])


async def test_tool_blocks_become_the_chat_conversation(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], tokenizer: Any
) -> None:
    """tool_use and tool_result blocks and tools reach the model as the chat conversation."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "2+5?"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Adding."},
            {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 5}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "7"}]},
            {"type": "text", "text": "So?"}]},
    ]  # fmt: skip
    message = await _create(_base(torch_proxy, attempt), True, model="tiny", max_tokens=6, extra_body=GREEDY,
                            messages=messages, tools=[TOOL], tool_choice={"type": "any"})  # fmt: skip
    (span,) = await llm_spans(proxy_store, attempt[0])
    recorded = check_torch_span(span, tokenizer, message.content[0].text, "anthropic.messages", stream=False)
    assert recorded == [
        {"role": "user", "content": "2+5?"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 5}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "7"},
        {"role": "user", "content": "So?"},
    ]  # fmt: skip
    request = json.loads(span.attributes[semconv.REQUEST_JSON])
    assert request["tools"] == [{"type": "function", "function": {
        "name": "add", "parameters": TOOL["input_schema"], "description": "Add two numbers"}}]  # fmt: skip
    assert request["tool_choice"] == "required"


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_tool_calls_become_tool_use_blocks(
    upstream_proxy: RunningProxy, chat_upstream: FakeOpenAI, attempt: tuple[str, str], stream: bool
) -> None:
    """A chat answer with tool_calls: a text block, a tool_use block with the parsed input,
    stop_reason tool_use; arguments that are not a JSON object come back as text."""
    bad = {"id": "toolu_8", "type": "function", "function": {"name": "add", "arguments": '{"a": 2,'}}
    chat_upstream.script({"content": "Adding.", "tool_calls": [TOOL_CALL, bad]})
    kwargs = {"model": "fake-model", "max_tokens": 20, "messages": [{"role": "user", "content": "2+5?"}],
              "tools": [TOOL]}  # fmt: skip
    base = _base(upstream_proxy, attempt)
    message = (await _stream(base, False, **kwargs))[1] if stream else await _create(base, True, **kwargs)
    assert [b.type for b in message.content] == ["text", "tool_use", "text"]
    assert message.content[0].text == "Adding."
    use = message.content[1]
    assert (use.id, use.name, use.input) == ("toolu_7", "add", {"a": 2, "b": 5})
    assert json.loads(message.content[2].text) == {"name": "add", "arguments": '{"a": 2,'}
    assert message.stop_reason == "tool_use"


@pytest.mark.parametrize(
    "body",
    [
        {"messages": USER},  # no max_tokens
        {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"max_tokens": 8, "messages": USER, "top_k": 5},
        {"max_tokens": 8, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"max_tokens": 8, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"max_tokens": 8, "messages": USER, "temperature": 1.5},
        {"max_tokens": 8, "messages": USER, "output_config": {"format": {"type": "json_schema", "schema": {}}}},
        {"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]},
        {"max_tokens": 8, "messages": []},
        {"max_tokens": 8, "messages": USER, "stop_sequences": ["x"] * 17},
        {"max_tokens": 8, "messages": [*USER, {"role": "assistant", "content": "The answer is"}]},
    ],
)
def test_unsupported_fields_are_a_400_in_anthropic_shape(torch_proxy: RunningProxy, body: dict[str, Any]) -> None:
    """What the proxy cannot serve is refused with Anthropic's error body, which its client raises."""
    response = httpx.post(f"{torch_proxy.url}/v1/messages", json={"model": "tiny", **body})
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert set(error["error"]) == {"type", "message"} and error["error"]["message"]
    client = anthropic.Anthropic(base_url=torch_proxy.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        client.post("/v1/messages", body={"model": "tiny", **body}, cast_to=object)


def test_other_errors_take_anthropics_shape(torch_proxy: RunningProxy) -> None:
    """An unknown model: 404 not_found_error, raised by the client as NotFoundError."""
    client = anthropic.Anthropic(base_url=torch_proxy.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="nope", max_tokens=4, messages=USER)
    assert raised.value.body["error"]["type"] == "not_found_error"
    assert httpx.get(f"{torch_proxy.url}/v1/messages").json()["type"] == "error"  # 405, same shape


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
async def test_a_retry_is_answered_from_the_record(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], stream: bool
) -> None:
    """Same idempotency key, retry count 1: one span, and the recorded answer as a Messages answer."""
    url = f"{torch_proxy.base(*attempt)}/messages"
    body = {"model": "tiny", "max_tokens": 8, "messages": USER, "stream": stream}
    texts = []
    for retry in ("0", "1"):
        headers = {"Idempotency-Key": f"key-{stream}", "x-stainless-retry-count": retry}
        reply = httpx.post(url, json=body, headers=headers)
        assert reply.status_code == 200
        if stream:
            data = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
            assert data[-1]["type"] == "message_stop"
            texts.append("".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta"))
        else:
            assert reply.json()["type"] == "message"
            texts.append(reply.json()["content"][0]["text"])
    assert texts[0] == texts[1]
    (span,) = await llm_spans(proxy_store, attempt[0])
    assert json.loads(span.attributes[semconv.RESPONSE_JSON])["content"] == texts[0]


def test_the_api_key_is_read_from_x_api_key(redis_server: Any, experiment: str, chat_upstream: FakeOpenAI) -> None:
    """With proxy keys set, the anthropic client's x-api-key is checked; a wrong one is a 401 it raises."""
    proxy = RunningProxy(redis_url=redis_server.url, experiment=experiment, proxy_backend="openai",
                         upstream_urls=chat_upstream.base_url, proxy_api_keys="key-one")  # fmt: skip
    try:
        kwargs = {"model": "fake-model", "max_tokens": 4, "messages": USER}
        message = anthropic.Anthropic(base_url=proxy.url, api_key="key-one").messages.create(**kwargs)
        assert message.content[0].text == chat_upstream.default_reply
        with pytest.raises(anthropic.AuthenticationError) as raised:
            anthropic.Anthropic(base_url=proxy.url, api_key="wrong", max_retries=0).messages.create(**kwargs)
        assert raised.value.body["error"]["type"] == "authentication_error"
    finally:
        proxy.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_on_the_vllm_backend_the_upstreams_ids_are_recorded(
    vllm_api_proxy: tuple[RunningProxy, FakeOpenAI], proxy_store: RedisStore, attempt: tuple[str, str], stream: bool
) -> None:
    """vllm backend: the upstream's token ids and log-probabilities, in the answer and the span."""
    proxy, _ = vllm_api_proxy
    kwargs = {"model": "m", "max_tokens": 8, "system": "Be brief.", "messages": [{"role": "user", "content": "2+2?"}]}
    base = _base(proxy, attempt)
    message = (await _stream(base, True, **kwargs))[1] if stream else await _create(base, False, **kwargs)
    assert message.content[0].text == "four" and message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 4
    (span,) = await llm_spans(proxy_store, attempt[0])
    a = span.attributes
    assert a[semconv.GEN_AI_SYSTEM] == "vllm" and a[semconv.TOKEN_FIDELITY] == "exact"
    assert tokens.ids(a[semconv.PROMPT_TOKEN_IDS]) == token_ids("Be brief.2+2?")
    assert tokens.ids(a[semconv.RESPONSE_TOKEN_IDS]) == token_ids("four")
    assert tokens.floats(a[semconv.RESPONSE_LOGPROBS]) == pytest.approx(fake_logprobs(4), abs=1e-6)


async def test_the_adapter_turns_the_calls_into_samples(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    """Two turns of one Messages conversation: a triplet each with the proxy's ids, and one
    trajectory sample whose mask covers exactly the model's tokens of both turns, as for chat calls."""
    base, kwargs = _base(torch_proxy, attempt), {"model": "tiny", "max_tokens": 6, "extra_body": GREEDY}
    first = await _create(base, True, messages=USER, **kwargs)
    history = [*USER, {"role": "assistant", "content": first.content}, {"role": "user", "content": "And 3+3?"}]
    second = await _create(base, False, messages=history, **kwargs)
    spans = await proxy_store.spans.query_spans(*attempt)
    info = AttemptInfo(attempt[0], attempt[1], "g", mode="train", group_size=1, reward=1.0)
    samples = spans_to_samples(spans, info)
    turns = [first.model_extra["token_ids"], second.model_extra["token_ids"]]
    assert [(s.shape, tokens.ids(s.response_token_ids)) for s in samples[:2]] == [("triplet", t) for t in turns]
    trajectory = samples[2]  # turn 2's prompt extends turn 1's: one trajectory over both
    assert trajectory.shape == "trajectory" and trajectory.num_turns == 2 and trajectory.model_version == "base"
    ids, mask = tokens.ids(trajectory.response_token_ids), tokens.mask(trajectory.response_mask)
    assert [t for t, m in zip(ids, mask, strict=True) if m] == turns[0] + turns[1]
    assert tokens.ids(trajectory.prompt_token_ids) + ids == second.model_extra["prompt_token_ids"] + turns[1]
