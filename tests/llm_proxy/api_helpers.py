"""Checks shared by the Responses and Messages API tests: the call's span, as a chat call's."""

from __future__ import annotations

import json
from typing import Any

from fulmen import tokens
from fulmen.records import Span
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen_llm_proxy.recording import API_ATTRIBUTE


async def llm_spans(store: RedisStore, rollout_id: str) -> list[Span]:
    spans = await store.spans.query_spans(rollout_id)
    return [s for s in spans if s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL]


def check_torch_span(span: Span, tokenizer: Any, text: str, api: str, *, stream: bool) -> list[dict[str, Any]]:
    """The span of a torch-served call: token ids that decode to ``text``, one log-probability per
    token, the served version, recorded as a chat call; returns the recorded chat messages."""
    a = span.attributes
    prompt_ids, ids = tokens.ids(a[semconv.PROMPT_TOKEN_IDS]), tokens.ids(a[semconv.RESPONSE_TOKEN_IDS])
    assert ids and tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(tokens.floats(a[semconv.RESPONSE_LOGPROBS])) == len(ids)
    assert a[semconv.GEN_AI_OPERATION] == "chat" and a[API_ATTRIBUTE] == api
    assert a[semconv.MODEL_VERSION] == "base" and a[semconv.TOKEN_FIDELITY] == "exact"
    assert a[semconv.STREAM] is stream and a[semconv.GEN_AI_INPUT_TOKENS] == len(prompt_ids)
    request = json.loads(a[semconv.REQUEST_JSON])
    # the torch backend renders the tools into the prompt unless tool_choice is "none"
    tools = request.get("tools") if request.get("tool_choice") != "none" else None
    rendered = tokenizer.apply_chat_template(request["messages"], tools=tools, add_generation_prompt=True,
                                             tokenize=False)
    assert prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert json.loads(a[semconv.RESPONSE_JSON])["content"] == text
    return request["messages"]
