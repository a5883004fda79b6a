"""Bad requests get the right status and an OpenAI-style error body, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from fakes.fake_openai import FakeOpenAI
from proxy_helpers import RunningProxy

from fulmen.store.redis.embedded import EmbeddedRedis

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def _still_serving(proxy: RunningProxy) -> None:
    response = httpx.post(f"{proxy.base()}/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text


def test_malformed_json_is_400(torch_proxy: RunningProxy) -> None:
    """Malformed JSON: 400 invalid_json; the next call is served."""
    response = httpx.post(
        f"{torch_proxy.base()}/chat/completions", content=b'{"model": "tiny", "messages": ['
    )
    _error(response, 400, "invalid_json")
    _still_serving(torch_proxy)


def test_bad_parameters_are_400_naming_the_param(torch_proxy: RunningProxy) -> None:
    """Out-of-range or ill-typed parameters: 400 with the parameter named."""
    url = f"{torch_proxy.base()}/chat/completions"
    for field, value in [("temperature", 5), ("max_tokens", 0), ("messages", "hi"), ("n", 0), ("stop", 3)]:
        error = _error(httpx.post(url, json={**CHAT, field: value}), 400)
        assert error["param"] == field
    _error(httpx.post(f"{torch_proxy.base()}/completions", json={"model": "tiny", "prompt": {"a": 1}}), 400)
    _still_serving(torch_proxy)


def test_unknown_model_is_404(torch_proxy: RunningProxy) -> None:
    """A model the proxy does not serve: 404 model_not_found (the openai client's NotFoundError)."""
    client = openai.OpenAI(base_url=torch_proxy.base(), api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=CHAT["messages"])
    assert caught.value.code == "model_not_found"
    _still_serving(torch_proxy)


def test_oversize_prompt_is_400_and_oversize_body_is_413(torch_proxy: RunningProxy) -> None:
    """A prompt longer than the context: 400 context_length_exceeded; a body over the limit: 413."""
    long_prompt = {"model": "tiny", "prompt": "x" * 2100, "max_tokens": 2}  # the tiny model's context is 2048
    _error(httpx.post(f"{torch_proxy.base()}/completions", json=long_prompt), 400, "context_length_exceeded")
    huge = {"model": "tiny", "prompt": "x" * (2 << 20)}
    _error(httpx.post(f"{torch_proxy.base()}/completions", json=huge), 413, "request_too_large")
    _still_serving(torch_proxy)


def test_unknown_route_and_method(torch_proxy: RunningProxy) -> None:
    """Unknown routes are 404 and a GET on a completion route is 405, both OpenAI-style."""
    _error(httpx.get(f"{torch_proxy.url}/v1/embeddings"), 404, "unknown_route")
    _error(httpx.get(f"{torch_proxy.url}/rollout/r1/v1/chat/completions"), 404)
    _error(httpx.get(f"{torch_proxy.base()}/chat/completions"), 405)
    _error(httpx.post(f"{torch_proxy.url}/rollout/r%20x/attempt/a/v1/chat/completions", json=CHAT), 400)
    _still_serving(torch_proxy)


@pytest.fixture
def keyed_proxy(redis_server: EmbeddedRedis, experiment: str) -> Iterator[RunningProxy]:
    """A proxy with API keys, in front of a fake upstream (no model to load)."""
    fake = FakeOpenAI()
    fake.start_in_thread()
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=experiment, proxy_backend="openai",
        upstream_urls=fake.base_url, proxy_api_keys="key-one,key-two",
    )  # fmt: skip
    yield proxy
    proxy.stop()
    fake.stop()


def test_missing_or_wrong_key_is_401(keyed_proxy: RunningProxy) -> None:
    """Without a valid bearer key: 401; with either configured key: served; probes need no key."""
    url = f"{keyed_proxy.base()}/chat/completions"
    _error(httpx.post(url, json=CHAT), 401, "invalid_api_key")
    _error(httpx.post(url, json=CHAT, headers={"Authorization": "Bearer nope"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_proxy.base(), api_key="wrong", max_retries=0).models.list()
    for key in ("key-one", "key-two"):
        assert httpx.post(url, json=CHAT, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(f"{keyed_proxy.url}/healthz").status_code == 200
