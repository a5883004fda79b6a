"""Property-based fuzz of the proxy's HTTP input: no body or header a client sends gets a 5xx."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_helpers import RunningProxy

from fulmen.telemetry import semconv

# Every character, lone surrogates included (json.dumps escapes them as \udXXX).
_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
_SCALARS = st.none() | st.booleans() | _TEXT | st.floats() | st.integers() | st.integers(min_value=2**63 - 2)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=20,
)
_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
           "stop", "stream", "stream_options", "n", "tools", "stop_token_ids", "return_tokens_as_token_ids"]  # fmt: skip
_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | _TEXT}, optional={"content": _JSON}),
    min_size=1, max_size=3,
)  # fmt: skip
_BODY = st.fixed_dictionaries(
    {"model": st.just("tiny") | _JSON, "max_tokens": st.just(2) | _JSON},
    optional={
        **{name: _JSON for name in _FIELDS if name not in ("model", "max_tokens", "messages", "prompt")},
        "messages": _MESSAGES | _JSON,
        "prompt": _TEXT | _JSON,
    },
)
_DEEP = st.integers(min_value=1, max_value=5000).map(
    lambda n: '{"model": "tiny", "x": ' + "[" * n + "]" * n + "}"
)
# Header values HTTP allows (visible ASCII, obs-text 0x80-0xff, inner spaces): any such bytes.
_HEADER_VALUE = st.binary(max_size=300).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F).strip())
_HEADERS = st.dictionaries(
    st.sampled_from([semconv.HEADER_ROLLOUT_ID, semconv.HEADER_ATTEMPT_ID, semconv.HEADER_IDEMPOTENCY_KEY,
                     "traceparent", "authorization", "content-type", "x-stainless-retry-count"]),
    _HEADER_VALUE, max_size=4,
)  # fmt: skip
_PATHS = st.sampled_from(
    ["/v1/chat/completions", "/v1/completions", "/rollout/r-fuzz/attempt/r-fuzz.1/v1/chat/completions"]
)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def _post(proxy: RunningProxy, path: str, content: bytes, headers: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{proxy.url}{path}", content=content, headers=headers, timeout=60)


@FUZZ
@given(body=_BODY, path=_PATHS, headers=_HEADERS)
def test_json_bodies_and_headers_never_5xx(
    torch_proxy: RunningProxy, body: dict, path: str, headers: dict
) -> None:
    """Random JSON shapes, values and header bytes: a 2xx or a 4xx with an OpenAI-style body."""
    response = _post(torch_proxy, path, json.dumps(body).encode(), headers)
    assert response.status_code < 500, (body, headers, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


@FUZZ
@given(
    raw=st.binary(max_size=2000)
    | _DEEP.map(str.encode)
    | _TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")),
    path=_PATHS,
)
def test_raw_bodies_never_5xx(torch_proxy: RunningProxy, raw: bytes, path: str) -> None:
    """Random bytes, any encoding, deep nesting: never a 5xx."""
    response = _post(torch_proxy, path, raw, {})
    assert response.status_code < 500, (raw[:200], response.text)
