"""Tool calls and n > 1 through a real proxy on the torch backend, with the official openai client.

The model's greedy output is scripted (`scripted_model`): the engine, backend, parser and recording
are the production ones, so each case shows what an agent gets for that output, and what is recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from proxy_helpers import RunningProxy
from scripted_model import script

from fulmen import tokens
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.telemetry import semconv

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}  # fmt: skip
SUB = {"type": "function", "function": {"name": "sub", "parameters": {"type": "object"}}}
VALID = '<tool_call>{"name": "add", "arguments": {"x": 7}}</tool_call>'
SCRIPTS = {
    "valid": VALID,
    "json": '<tool_call>{"name": "add", "arguments": {"x": 7}</tool_call>',
    "schema": '<tool_call>{"name": "add", "arguments": {"x": "7"}}</tool_call>',
    "unknown": '<tool_call>{"name": "mul", "arguments": {"x": 7}}</tool_call>',
    "sub": '<tool_call>{"name": "sub", "arguments": {}}</tool_call>',
    "text": "no tool needed",
    "both": "ok " + VALID,
}


@pytest.fixture(scope="module")
def proxy(redis_server: EmbeddedRedis, tiny_model: Path, module_experiment: str) -> Iterator[RunningProxy]:
    running = RunningProxy(
        redis_url=redis_server.url, experiment=module_experiment, proxy_backend="torch", model_dir=tiny_model
    )
    script(running, SCRIPTS)
    yield running
    running.stop()


def chat(proxy: RunningProxy, attempt: tuple[str, str], user: str, **kwargs: object):
    client = openai.OpenAI(base_url=proxy.base(*attempt), api_key="unused", max_retries=0)
    kwargs.setdefault("tools", [ADD])
    kwargs.setdefault("max_tokens", 80)
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": user}], temperature=0, **kwargs
    )


async def one_span(store: RedisStore, attempt: tuple[str, str]):
    [span] = await store.spans.query_spans(attempt[0])
    return span


def decoded(proxy: RunningProxy, ids: object) -> str:
    return proxy.app.service.backend.engine.tokenizer.decode(tokens.ids(ids), skip_special_tokens=True)


async def test_a_valid_call_is_tool_calls_and_the_span_keeps_the_raw_tokens(
    proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    response = chat(proxy, attempt, "valid")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"x": 7}
    prompt = decoded(proxy, response.model_extra["prompt_token_ids"])
    assert '<tools>\n{"name": "add"' in prompt  # the template rendered the tool
    span = await one_span(proxy_store, attempt)
    # the adapter trains on the model's tokens: the raw call text, not the parsed call
    assert decoded(proxy, span.attributes[semconv.RESPONSE_TOKEN_IDS]) == VALID
    assert tokens.ids(span.attributes[semconv.RESPONSE_TOKEN_IDS]) == choice.model_extra["token_ids"]
    recorded = json.loads(span.attributes[semconv.RESPONSE_JSON])
    assert recorded["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"x": 7}'}
    assert span.attributes[semconv.GEN_AI_FINISH_REASONS] == ["tool_calls"]


@pytest.mark.parametrize(
    ("user", "max_tokens", "finish", "reason"),
    [
        ("json", 80, "stop", "not valid JSON"),
        ("schema", 80, "stop", "expected integer, got string"),
        ("unknown", 80, "stop", "'mul', which is not a tool offered"),
        ("valid", 20, "length", "never closed"),  # a partial call: cut by max_tokens
    ],
)
async def test_a_malformed_call_is_plain_text_never_a_5xx(
    proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str], user: str, max_tokens: int,
    finish: str, reason: str,
) -> None:
    response = chat(proxy, attempt, user, max_tokens=max_tokens)
    choice = response.choices[0]
    raw = SCRIPTS[user][:max_tokens]
    assert choice.message.tool_calls is None and choice.message.content == raw.strip()  # stripped, as content is
    assert choice.finish_reason == finish and reason in choice.model_extra["fulmen_tool_error"]
    span = await one_span(proxy_store, attempt)
    assert decoded(proxy, span.attributes[semconv.RESPONSE_TOKEN_IDS]) == raw


async def test_streaming_delivers_content_then_the_tool_calls_at_the_end(
    proxy: RunningProxy, proxy_store: RedisStore, attempt: tuple[str, str]
) -> None:
    client = openai.AsyncOpenAI(base_url=proxy.base(*attempt), api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "both"}], tools=[ADD], temperature=0,
        max_tokens=80, stream=True,
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == "ok" and finishes == ["tool_calls"]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [(0, "add", {"x": 7})]
    # every token still streamed its id, the tag's included
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    span = await one_span(proxy_store, attempt)
    assert ids == tokens.ids(span.attributes[semconv.RESPONSE_TOKEN_IDS])
    assert decoded(proxy, ids) == SCRIPTS["both"]


async def test_streaming_a_malformed_call_sends_it_as_content(
    proxy: RunningProxy, attempt: tuple[str, str]
) -> None:
    client = openai.OpenAI(base_url=proxy.base(*attempt), api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "schema"}], tools=[ADD], temperature=0,
        max_tokens=80, stream=True,
    ))  # fmt: skip
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == SCRIPTS["schema"]
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


async def test_tool_choice_none_renders_no_tools_and_parses_nothing(
    proxy: RunningProxy, attempt: tuple[str, str]
) -> None:
    response = chat(proxy, attempt, "valid", tool_choice="none")
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content == VALID and response.choices[0].finish_reason == "stop"
    assert "<tools>" not in decoded(proxy, response.model_extra["prompt_token_ids"])


async def test_tool_choice_required_and_named(proxy: RunningProxy, attempt: tuple[str, str]) -> None:
    required = chat(proxy, attempt, "text", tool_choice="required").choices[0]
    assert required.message.content == "no tool needed" and required.finish_reason == "stop"
    assert "tool_choice asks for a tool call" in required.model_extra["fulmen_tool_error"]
    named = {"type": "function", "function": {"name": "add"}}
    response = chat(proxy, attempt, "sub", tools=[ADD, SUB], tool_choice=named)
    prompt = decoded(proxy, response.model_extra["prompt_token_ids"])
    assert '"name": "add"' in prompt and '"name": "sub"' not in prompt  # only the named tool rendered
    assert response.choices[0].message.tool_calls is None  # the model called another tool: text
    assert chat(proxy, attempt, "valid", tools=[ADD, SUB], tool_choice=named).choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        chat(proxy, attempt, "valid", tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tools"):
        chat(proxy, attempt, "valid", tools=[{"type": "function", "function": {"name": "bad name"}}])


async def test_an_assistant_tool_call_turn_renders_as_the_model_writes_it(
    proxy: RunningProxy, attempt: tuple[str, str]
) -> None:
    """The next turn's prompt holds the call as the model wrote it, so a trajectory's prompts extend."""
    first = chat(proxy, attempt, "valid")
    call = first.choices[0].message.tool_calls[0]
    client = openai.OpenAI(base_url=proxy.base(*attempt), api_key="unused", max_retries=0)
    second = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=4, tools=[ADD], messages=[
            {"role": "user", "content": "valid"},
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "8"},
        ],
    )  # fmt: skip
    before = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"][: len(before)] == before
