"""The torch backend's token limits: the default max tokens is a setting (flag and FULMEN_* variable), and
an answer cut by max tokens or by the model's context finishes with "length", its span says which limit
cut it (``fulmen.truncated_by``), and the proxy logs a warning once per cause."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from proxy_helpers import RunningProxy

from fulmen.demo.tiny_model import DEFAULT_ALPHABET, SPECIAL_TOKENS, TinyModelSpec, build_tiny_model
from fulmen.settings import ProxySettings
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.telemetry import semconv
from fulmen_llm_proxy import recording
from fulmen_llm_proxy.backends.base import Call, Result

CONTEXT = 48  # positions of this module's model: a short prompt reaches them
DEFAULT_MAX_TOKENS = 5
VOCAB = len(SPECIAL_TOKENS) + len(DEFAULT_ALPHABET)  # every token a stop token: the answer stops at once


@pytest.fixture(scope="module")
def short_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TinyModelSpec(max_position_embeddings=CONTEXT))


@pytest.fixture(scope="module")
def capped_proxy(redis_server: EmbeddedRedis, short_model: Path, module_experiment: str) -> Iterator[RunningProxy]:
    proxy = RunningProxy(redis_url=redis_server.url, experiment=module_experiment, proxy_backend="torch",
                         model_dir=short_model, default_max_tokens=DEFAULT_MAX_TOKENS)
    yield proxy
    proxy.stop()


def test_default_max_tokens_is_a_documented_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """default_max_tokens: 256 unless FULMEN_DEFAULT_MAX_TOKENS says otherwise, with a description."""
    assert ProxySettings().default_max_tokens == 256
    assert "max_tokens" in (ProxySettings.model_fields["default_max_tokens"].description or "")
    monkeypatch.setenv("FULMEN_DEFAULT_MAX_TOKENS", "1000")
    assert ProxySettings().default_max_tokens == 1000


async def _span(store: RedisStore, rollout_id: str) -> dict:
    (span,) = [s for s in await store.spans.query_spans(rollout_id)
               if s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL]
    return span.attributes


async def test_cut_answers_say_which_limit_cut_them(
    capped_proxy: RunningProxy, proxy_store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    """No max_tokens: the setting's cap, truncated_by max_tokens; a prompt near the context: truncated_by
    context_length; an answer that stops by itself: no truncated_by; one log warning per cause."""
    recording._WARNED.clear()
    caplog.set_level(logging.WARNING, logger=recording.__name__)
    attempts = [(await proxy_store.rollouts.start_rollout({"task": i}, "w")) for i in range(4)]
    bodies = [
        {"model": "tiny", "prompt": "12+7=", "temperature": 0},  # the proxy's default max tokens
        {"model": "tiny", "prompt": "1" * (CONTEXT - 4), "max_tokens": 30, "temperature": 0},  # the context
        {"model": "tiny", "prompt": "2+2=", "max_tokens": 30, "temperature": 0, "stop_token_ids": list(range(VOCAB))},
        {"model": "tiny", "prompt": "1" * (CONTEXT - 3), "max_tokens": 30, "temperature": 0},  # again: no new warning
    ]
    choices = []
    async with httpx.AsyncClient(timeout=60) as client:
        for started, body in zip(attempts, bodies, strict=True):
            url = capped_proxy.base(started.rollout.rollout_id, started.attempt.attempt_id) + "/completions"
            response = await client.post(url, json=body)
            assert response.status_code == 200, response.text
            choices.append(response.json()["choices"][0])
    spans = [await _span(proxy_store, s.rollout.rollout_id) for s in attempts]

    assert len(choices[0]["token_ids"]) == DEFAULT_MAX_TOKENS and choices[0]["finish_reason"] == "length"
    assert spans[0][semconv.TRUNCATED_BY] == "max_tokens"
    assert choices[1]["finish_reason"] == "length" and len(choices[1]["token_ids"]) < 30
    assert spans[1][semconv.TRUNCATED_BY] == "context_length"
    assert choices[2]["finish_reason"] == "stop" and semconv.TRUNCATED_BY not in spans[2]
    assert spans[3][semconv.TRUNCATED_BY] == "context_length"
    warnings = [r.getMessage() for r in caplog.records if "was cut by" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert "cut by max_tokens" in warnings[0] and "FULMEN_DEFAULT_MAX_TOKENS" in warnings[0]
    assert "cut by context_length" in warnings[1]


def test_upstream_cuts_are_inferred() -> None:
    """A backend that cannot tell: the call's max_tokens when the answer reached it, Anthropic's own
    max_tokens when the call set none, else the upstream's context."""
    def call(max_tokens: int | None) -> Call:
        return Call("chat", {}, "m", False, max_tokens, 1.0, 1.0, None, [])

    cut = Result(finish_reason="length", output_tokens=16)
    assert recording.truncation(call(16), cut, "vllm") == "max_tokens"
    assert recording.truncation(call(100), cut, "vllm") == "context_length"
    assert recording.truncation(call(None), cut, "openai") == "context_length"
    assert recording.truncation(call(None), cut, "anthropic") == "max_tokens"
