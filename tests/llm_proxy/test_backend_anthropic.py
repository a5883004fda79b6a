"""The anthropic backend against a fake Anthropic Messages server on loopback: the chat call as the
exact Messages request, the answer as the chat completion, streaming and not, text-only spans, the
proxy's own /v1/messages through it, retries on 529, and clear 400s / 502s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from api_helpers import llm_spans
from fakes.fake_anthropic import FakeAnthropic
from proxy_helpers import RunningProxy

from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.telemetry import semconv
from fulmen.versions.model_version import BASE_VERSION

KEY = "sk-ant-upstream"
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
WEATHER_TOOL = {"name": "weather", "description": "Weather in a city",
                "input_schema": WEATHER["function"]["parameters"]}  # fmt: skip
USE = {"id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeAnthropic]:
    server = FakeAnthropic(api_key=KEY)
    server.start_in_thread()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(redis_server: EmbeddedRedis, module_experiment: str, fake: FakeAnthropic) -> Iterator[RunningProxy]:
    running = RunningProxy(
        redis_url=redis_server.url, experiment=module_experiment, proxy_backend="anthropic",
        upstream_urls=fake.base_url, upstream_api_key=KEY, upstream_max_tokens=777, upstream_backoff_s=0.01,
    )  # fmt: skip
    yield running
    running.stop()


def _sent(fake: FakeAnthropic) -> dict[str, Any]:
    request = fake.requests[-1]
    assert request.path == "/v1/messages"
    assert request.headers["x-api-key"] == KEY and request.headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in request.headers
    return request.body


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_a_plain_chat_call_is_a_messages_request_and_a_text_only_span(
    proxy: RunningProxy, fake: FakeAnthropic, proxy_store: RedisStore, attempt: tuple[str, str], stream: bool
) -> None:
    fake.script("Bonjour !")
    client = openai.OpenAI(base_url=proxy.base(*attempt), api_key="unused")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    kwargs: dict[str, Any] = {"model": "claude-x", "messages": messages, "temperature": 0.5, "stop": ["\n\n"]}
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
        finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
        usage = chunks[-1].usage
        assert chunks[0].id.startswith("msg_fake") and chunks[0].choices[0].delta.role == "assistant"
    else:
        response = client.chat.completions.create(**kwargs)
        text, finish, usage = response.choices[0].message.content, [response.choices[0].finish_reason], response.usage
        assert response.id.startswith("msg_fake") and response.model == "claude-x"
        assert response.model_extra["model_version"] == BASE_VERSION.name
    assert text == "Bonjour !" and finish == ["stop"]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (21, 9, 30)
    expected = {"model": "claude-x", "max_tokens": 777, "system": "Be brief.",
                "messages": [{"role": "user", "content": "Say hi"}], "temperature": 0.5, "stop_sequences": ["\n\n"]}  # fmt: skip
    assert _sent(fake) == ({**expected, "stream": True} if stream else expected)
    (span,) = await llm_spans(proxy_store, attempt[0])
    a = span.attributes
    assert a[semconv.GEN_AI_SYSTEM] == "anthropic" and a[semconv.TOKEN_FIDELITY] == "text_only"
    assert a[semconv.MODEL_VERSION] == BASE_VERSION.name and semconv.RESPONSE_TOKEN_IDS not in a
    assert json.loads(a[semconv.RESPONSE_JSON]) == {"role": "assistant", "content": "Bonjour !"}
    assert (a[semconv.GEN_AI_INPUT_TOKENS], a[semconv.GEN_AI_OUTPUT_TOKENS]) == (21, 9)


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_a_multi_turn_tool_conversation(
    proxy: RunningProxy, fake: FakeAnthropic, proxy_store: RedisStore, attempt: tuple[str, str], stream: bool
) -> None:
    """Tool calls out as tool_use blocks, tool results in as tool_result blocks, same-role turns merged;
    the upstream's tool_use back as chat tool_calls."""
    fake.script({"content": "Checking.", "tool_uses": [USE, {"id": "toolu_2", "name": "weather", "input": {}}]})
    messages = [
        {"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "rain"}]},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
    ]  # fmt: skip
    client = openai.OpenAI(base_url=proxy.base(*attempt), api_key="unused")
    kwargs: dict[str, Any] = {"model": "claude-x", "messages": messages, "tools": [WEATHER],
                              "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 50}  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
        calls: dict[int, dict[str, str]] = {}
        for c in chunks:
            for ch in c.choices:
                for d in ch.delta.tool_calls or ():
                    call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] += d.id or ""
                    call["name"] += (d.function.name or "") if d.function else ""
                    call["arguments"] += (d.function.arguments or "") if d.function else ""
        got = [calls[i] for i in sorted(calls)]
        finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    else:
        message = (response := client.chat.completions.create(**kwargs)).choices[0].message
        text, finish = message.content, [response.choices[0].finish_reason]
        got = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in message.tool_calls]
    assert text == "Checking." and finish == ["tool_calls"]
    assert [(g["id"], g["name"], json.loads(g["arguments"])) for g in got] == [
        ("toolu_1", "weather", {"city": "Paris"}), ("toolu_2", "weather", {})]
    expected = {
        "model": "claude-x", "max_tokens": 50, "system": "You help.",
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_a", "name": "weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "call_b", "name": "weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_a", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "call_b", "content": "rain"},
                {"type": "text", "text": "And now?"}]},
        ],
        "tools": [WEATHER_TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    }  # fmt: skip
    assert _sent(fake) == ({**expected, "stream": True} if stream else expected)
    (span,) = await llm_spans(proxy_store, attempt[0])
    recorded = json.loads(span.attributes[semconv.RESPONSE_JSON])
    assert [c["function"]["name"] for c in recorded["tool_calls"]] == ["weather", "weather"]


@pytest.mark.parametrize("choice,sent", [("auto", {"type": "auto"}), ("none", {"type": "none"}),
                                         ({"type": "function", "function": {"name": "weather"}},
                                          {"type": "tool", "name": "weather"})])  # fmt: skip
def test_tool_choice_maps(proxy: RunningProxy, fake: FakeAnthropic, choice: Any, sent: dict[str, Any]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": choice}
    assert httpx.post(f"{proxy.base()}/chat/completions", json=body).status_code == 200
    assert _sent(fake)["tool_choice"] == sent


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_the_anthropic_client_round_trips_through_the_proxy(
    proxy: RunningProxy, fake: FakeAnthropic, proxy_store: RedisStore, attempt: tuple[str, str], stream: bool
) -> None:
    """Messages -> chat -> Messages upstream -> chat -> Messages: tool_use out, tool_result in."""
    fake.script({"content": "Let me check.", "tool_uses": [USE]})
    client = anthropic.Anthropic(base_url=proxy.base(*attempt)[:-3], api_key="unused")
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_0", "name": "weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "snow"}]},
    ]  # fmt: skip
    kwargs: dict[str, Any] = {"model": "claude-x", "max_tokens": 64, "system": "Be brief.", "messages": messages,
                              "tools": [WEATHER_TOOL], "tool_choice": {"type": "auto"}}  # fmt: skip
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Let me check."
    assert (message.content[1].id, message.content[1].name, message.content[1].input) == ("toolu_1", "weather", {"city": "Paris"})
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 13
    expected = {"model": "claude-x", "max_tokens": 64, "system": "Be brief.", "messages": messages,
                "tools": [WEATHER_TOOL], "tool_choice": {"type": "auto"}}  # fmt: skip
    assert _sent(fake) == ({**expected, "stream": True} if stream else expected)
    (span,) = await llm_spans(proxy_store, attempt[0])
    assert span.attributes[semconv.TOKEN_FIDELITY] == "text_only"


def test_529_then_200_is_retried(proxy: RunningProxy, fake: FakeAnthropic) -> None:
    """Overloaded (529, Retry-After 0) then 429 then an answer: three sends, one 200."""
    before = len(fake.requests)
    fake.script({"status": 529, "retry_after": 0}, {"status": 429, "retry_after": 0}, "ok")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(f"{proxy.base()}/chat/completions", json=body)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "ok"
    assert len(fake.requests) - before == 3


def test_errors_are_clear(proxy: RunningProxy, fake: FakeAnthropic) -> None:
    """Completions and chat fields Anthropic lacks: 400 with the reason, nothing sent; an upstream
    4xx keeps its status and message; 529 every time is a 502 naming it; an unknown block a 502 naming it."""
    url = proxy.base()
    before = len(fake.requests)
    refused = httpx.post(f"{url}/completions", json={"model": "m", "prompt": "2+2="})
    assert refused.status_code == 400 and "no completions API" in refused.json()["error"]["message"]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for extra, name in (({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"temperature": 1.5}, "temperature"),
                        ({"response_format": {"type": "json_object"}}, "response_format")):  # fmt: skip
        answer = httpx.post(f"{url}/chat/completions", json={**chat, **extra})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == name, answer.text
    assert len(fake.requests) == before
    fake.script({"status": 400, "message": "max_tokens: too large"}, *[{"status": 529, "message": "Overloaded"}] * 3,
                {"blocks": [{"type": "server_tool_use", "id": "x", "name": "web_search", "input": {}}]})  # fmt: skip
    bad = httpx.post(f"{url}/chat/completions", json=chat)
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "max_tokens: too large"
    overloaded = httpx.post(f"{url}/chat/completions", json=chat)
    assert overloaded.status_code == 502 and "Overloaded" in overloaded.json()["error"]["message"]
    unknown = httpx.post(f"{url}/chat/completions", json=chat)
    assert unknown.status_code == 502 and "'server_tool_use'" in unknown.json()["error"]["message"]
    assert httpx.post(f"{url}/chat/completions", json=chat).status_code == 200  # still serving


def test_an_error_event_mid_stream_reaches_the_client(proxy: RunningProxy, fake: FakeAnthropic) -> None:
    fake.script({"content": "Partial answer", "error_event": True})
    client = openai.OpenAI(base_url=proxy.base(), api_key="unused")
    with pytest.raises(openai.APIError, match="Overloaded"):
        list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True))


def test_the_builder_gives_the_key_as_x_api_key_and_the_default_max_tokens() -> None:
    from fulmen.settings import ProxySettings
    from fulmen_llm_proxy.backends.registry import make_backend

    settings = ProxySettings(proxy_backend="anthropic", upstream_urls="https://api.example/v1", upstream_api_key=KEY,
                             upstream_max_tokens=99)  # fmt: skip
    backend = make_backend(settings)
    assert backend.system == "anthropic" and backend.default_max_tokens == 99  # type: ignore[attr-defined]
    head = backend.upstreams.pools[0]._head.decode()  # type: ignore[attr-defined]
    assert f"x-api-key: {KEY}\r\n" in head and "anthropic-version: 2023-06-01\r\n" in head
    assert "authorization" not in head.lower()


def test_a_temperature_0_call_is_served_from_the_cache(
    redis_server: EmbeddedRedis, module_experiment: str, fake: FakeAnthropic
) -> None:
    """With upstream_cache_entries, the same temperature-0 call again costs no upstream request."""
    cached = RunningProxy(redis_url=redis_server.url, experiment=module_experiment, proxy_backend="anthropic",
                          upstream_urls=fake.base_url, upstream_api_key=KEY, upstream_cache_entries=4)  # fmt: skip
    try:
        fake.script("cached answer")
        body = {"model": "m", "messages": [{"role": "user", "content": "critic?"}], "temperature": 0}
        before = len(fake.requests)
        texts = [httpx.post(f"{cached.base()}/chat/completions", json=body).json()["choices"][0]["message"]["content"]
                 for _ in range(2)]  # fmt: skip
        assert texts == ["cached answer"] * 2 and len(fake.requests) == before + 1
    finally:
        cached.stop()


def test_the_responses_api_and_thinking_blocks(proxy: RunningProxy, fake: FakeAnthropic) -> None:
    """A Responses call goes up as Messages (instructions as system); a thinking block is dropped."""
    fake.script({"blocks": [{"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "text", "text": "42"}]})
    client = openai.OpenAI(base_url=proxy.base(), api_key="unused")
    response = client.responses.create(model="claude-x", input="6*7?", instructions="Answer only.")
    assert response.output_text == "42"
    assert _sent(fake) == {"model": "claude-x", "max_tokens": 777, "system": "Answer only.",
                           "messages": [{"role": "user", "content": "6*7?"}]}  # fmt: skip
