"""The OpenAI Responses API (``POST /v1/responses``) on the proxy, called with the official openai
client: on the torch backend (sync and async, streaming and not, each call a recorded chat span),
tool calls mapped from an OpenAI-compatible upstream, multi-turn input items, 400s for what it
cannot serve, and a client retry answered from the record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from api_helpers import check_torch_span, llm_spans
from fakes.fake_openai import FakeOpenAI, fake_logprobs, token_ids
from proxy_helpers import RunningProxy

from fulmen import tokens
from fulmen.demo.tiny_model import load_tiny_model
from fulmen.store import RedisStore
from fulmen.telemetry import semconv

TOOL = {"type": "function", "name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}  # fmt: skip
TOOL_CALL = {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 5}'}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return load_tiny_model(tiny_model)[1]


async def _create(base: str, sync: bool, **kwargs: Any) -> Any:
    if sync:
        return openai.OpenAI(base_url=base, api_key="unused").responses.create(**kwargs)
    async with openai.AsyncOpenAI(base_url=base, api_key="unused") as client:
        return await client.responses.create(**kwargs)


async def _events(base: str, sync: bool, **kwargs: Any) -> list[Any]:
    if sync:
        return list(openai.OpenAI(base_url=base, api_key="unused").responses.create(stream=True, **kwargs))
    async with openai.AsyncOpenAI(base_url=base, api_key="unused") as client:
        return [e async for e in await client.responses.create(stream=True, **kwargs)]


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_create_on_torch_is_a_recorded_chat_call(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], tokenizer: Any, sync: bool
) -> None:
    """Not streaming: output_text is the model's text, its ids are in the body and the span."""
    response = await _create(torch_proxy.base(*attempt), sync, model="tiny", instructions="Be brief.",
                             input="12+7=", max_output_tokens=12, temperature=0,
                             include=["message.output_text.logprobs"], store=False)  # fmt: skip
    assert response.object == "response" and response.model == "tiny"
    assert response.status in ("completed", "incomplete")
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.output_tokens == len(response.model_extra["token_ids"])
    assert response.model_extra["model_version"] == "base"
    (span,) = await llm_spans(proxy_store, attempt[0])
    messages = check_torch_span(span, tokenizer, response.output_text, "openai.responses", stream=False)
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+7="}]
    assert tokens.ids(span.attributes[semconv.RESPONSE_TOKEN_IDS]) == response.model_extra["token_ids"]
    assert span.attributes[semconv.GEN_AI_MAX_TOKENS] == 12
    logprobs = [lp.logprob for lp in response.output[0].content[0].logprobs]
    assert logprobs == pytest.approx(tokens.floats(span.attributes[semconv.RESPONSE_LOGPROBS]), abs=1e-6)
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_streaming_on_torch_sends_the_openai_events(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], tokenizer: Any, sync: bool
) -> None:
    """Streaming: created, in_progress, the text as deltas, done events, completed with it all."""
    events = await _events(torch_proxy.base(*attempt), sync, model="tiny", input="3+4=",
                           max_output_tokens=10, temperature=0)  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text
    (span,) = await llm_spans(proxy_store, attempt[0])
    check_torch_span(span, tokenizer, text, "openai.responses", stream=True)
    assert final.model_extra["token_ids"] == tokens.ids(span.attributes[semconv.RESPONSE_TOKEN_IDS])
    assert final.usage.output_tokens == len(final.model_extra["token_ids"])


async def test_input_items_become_the_chat_conversation(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], tokenizer: Any
) -> None:
    """Messages, a function call and its output, and function tools reach the model as the chat
    conversation (the recorded request), whose rendering is the prompt the model saw."""
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+5?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2,"b":5}'},
        {"type": "function_call_output", "call_id": "c1", "output": "7"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]
    response = await _create(torch_proxy.base(*attempt), True, model="tiny", input=items, tools=[TOOL],
                             tool_choice="auto", max_output_tokens=6, temperature=0)  # fmt: skip
    (span,) = await llm_spans(proxy_store, attempt[0])
    messages = check_torch_span(span, tokenizer, response.output_text, "openai.responses", stream=False)
    assert messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2+5?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":5}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "7"},
    ]  # fmt: skip
    request = json.loads(span.attributes[semconv.REQUEST_JSON])
    assert request["tools"] == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert request["tool_choice"] == "auto"


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
async def test_tool_calls_become_function_call_items(
    upstream_proxy: RunningProxy, chat_upstream: FakeOpenAI, proxy_store: RedisStore,
    attempt: tuple[str, str], stream: bool,
) -> None:  # fmt: skip
    """A chat answer with text and tool_calls: a message item, then a function_call item per call."""
    chat_upstream.script({"content": "Adding.", "tool_calls": [TOOL_CALL]})
    kwargs = {"model": "fake-model", "input": "2+5?", "tools": [TOOL]}
    if stream:
        events = await _events(upstream_proxy.base(*attempt), False, **kwargs)
        response = events[-1].response
        kinds = [e.type for e in events]
        assert kinds.count("response.function_call_arguments.delta") == 1
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert (done.name, done.arguments, done.output_index) == ("add", '{"a": 2, "b": 5}', 1)
    else:
        response = await _create(upstream_proxy.base(*attempt), True, **kwargs)
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Adding."
    call = response.output[1]
    assert (call.call_id, call.name, json.loads(call.arguments)) == ("call_7", "add", {"a": 2, "b": 5})
    sent = chat_upstream.requests[-1].body
    assert sent["tools"][0]["function"]["name"] == "add" and sent["messages"] == [{"role": "user", "content": "2+5?"}]
    (span,) = await llm_spans(proxy_store, attempt[0])
    assert json.loads(span.attributes[semconv.RESPONSE_JSON])["tool_calls"][0]["id"] == "call_7"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
    ],
)
def test_unsupported_fields_are_a_400_in_openai_shape(
    torch_proxy: RunningProxy, extra: dict[str, Any], param: str
) -> None:
    """What the proxy cannot serve is refused by name, as OpenAI refuses it, never ignored."""
    body = {"model": "tiny", "input": "hi", **extra}
    response = httpx.post(f"{torch_proxy.base()}/responses", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    with pytest.raises(openai.BadRequestError):
        # extra_body: the client's signature has no unknown parameters
        openai.OpenAI(base_url=torch_proxy.base(), api_key="unused").responses.create(
            model="tiny", input="hi", extra_body=extra
        )


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
async def test_a_retry_is_answered_from_the_record(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], stream: bool
) -> None:
    """Same idempotency key, retry count 1: one span, and the recorded answer in the Responses shape."""
    url = f"{torch_proxy.base(*attempt)}/responses"
    body = {"model": "tiny", "input": "5+5=", "max_output_tokens": 8, "stream": stream}
    texts = []
    for retry in ("0", "1"):
        headers = {"Idempotency-Key": f"key-{stream}", "x-stainless-retry-count": retry}
        reply = httpx.post(url, json=body, headers=headers)
        assert reply.status_code == 200
        if stream:
            last = [line for line in reply.text.splitlines() if line.startswith("data: ")][-1]
            reply_body = json.loads(last[6:])["response"]
        else:
            reply_body = reply.json()
        assert reply_body["object"] == "response"
        texts.append(reply_body["output"][0]["content"][0]["text"])
    assert texts[0] == texts[1]
    (span,) = await llm_spans(proxy_store, attempt[0])
    assert json.loads(span.attributes[semconv.RESPONSE_JSON])["content"] == texts[0]


async def test_the_clients_stream_helper_accumulates_the_events(
    upstream_proxy: RunningProxy, chat_upstream: FakeOpenAI, attempt: tuple[str, str]
) -> None:
    """``responses.stream``: its accumulator takes the events in order and ends with the response
    (it needs ``response.completed``: an upstream that ends with "stop", unlike the tiny model
    cut at its token limit, which ends ``incomplete``, as OpenAI does)."""
    chat_upstream.script("Hello there!")
    client = openai.AsyncOpenAI(base_url=upstream_proxy.base(*attempt), api_key="unused")
    async with client, client.responses.stream(model="fake-model", input="hi") as stream:
        text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
        final = await stream.get_final_response()
    assert final.output_text == text == "Hello there!" and final.status == "completed"
    assert final.usage.output_tokens > 0  # from the usage chunk the proxy asked the upstream for


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
async def test_on_the_vllm_backend_the_upstreams_ids_are_recorded(
    vllm_api_proxy: tuple[RunningProxy, FakeOpenAI], proxy_store: RedisStore, attempt: tuple[str, str], stream: bool
) -> None:
    """vllm backend: the upstream's token ids and log-probabilities, in the answer and the span."""
    proxy, _ = vllm_api_proxy
    kwargs = {"model": "m", "instructions": "Be brief.", "input": "2+2?"}
    if stream:
        final = (await _events(proxy.base(*attempt), False, **kwargs))[-1].response
    else:
        final = await _create(proxy.base(*attempt), True, **kwargs)
    assert final.output_text == "four" and final.model_extra["token_ids"] == token_ids("four")
    (span,) = await llm_spans(proxy_store, attempt[0])
    a = span.attributes
    assert a[semconv.GEN_AI_SYSTEM] == "vllm" and a[semconv.TOKEN_FIDELITY] == "exact"
    assert tokens.ids(a[semconv.PROMPT_TOKEN_IDS]) == token_ids("Be brief.2+2?")
    assert tokens.ids(a[semconv.RESPONSE_TOKEN_IDS]) == token_ids("four")
    assert tokens.floats(a[semconv.RESPONSE_LOGPROBS]) == pytest.approx(fake_logprobs(4), abs=1e-6)


async def test_attributed_by_headers_and_the_version_in_a_header(
    torch_proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    """The x-fulmen-* headers attribute a call as the path prefix does; the served version comes back
    in x-fulmen-model-version, for both APIs."""
    ids = {semconv.HEADER_ROLLOUT_ID: attempt[0], semconv.HEADER_ATTEMPT_ID: attempt[1]}
    responses = httpx.post(f"{torch_proxy.base()}/responses", headers=ids,
                           json={"model": "tiny", "input": "1+1=", "max_output_tokens": 4})  # fmt: skip
    messages = httpx.post(f"{torch_proxy.url}/v1/messages", headers=ids,
                          json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "1+1="}]})  # fmt: skip
    for reply in (responses, messages):
        assert reply.status_code == 200 and reply.headers[semconv.HEADER_MODEL_VERSION] == "base"
    spans = await llm_spans(proxy_store, attempt[0])
    assert [(s.attempt_id, s.attributes["fulmen.api"]) for s in spans] == [
        (attempt[1], "openai.responses"), (attempt[1], "anthropic.messages")]  # fmt: skip
    assert [tokens.ids(s.attributes[semconv.RESPONSE_TOKEN_IDS]) for s in spans] == [
        responses.json()["token_ids"], messages.json()["token_ids"]]  # fmt: skip
