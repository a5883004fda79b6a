"""Client-caused errors are 4xx, never 500, and half-open connections are not held forever."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from fakes.fake_openai import FakeOpenAI
from proxy_helpers import RunningProxy

from fulmen import keys
from fulmen.errors import InvalidInput
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen_llm_proxy import server

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}


def _status(response: httpx.Response) -> int:
    if response.status_code >= 400:
        error = response.json()["error"]  # always an OpenAI-style body
        assert error["message"]
    return response.status_code


def _still_serving(proxy: RunningProxy) -> None:
    assert httpx.post(f"{proxy.base()}/chat/completions", json=CHAT).status_code == 200


def test_deeply_nested_json_is_400(torch_proxy: RunningProxy, attempt: tuple[str, str]) -> None:
    """JSON nested 2,000 deep (beyond the parser) or 200 deep (beyond the cap): 400, not 500."""
    url = f"{torch_proxy.base(*attempt)}/chat/completions"
    for depth in (2000, 200):
        nested = "[" * depth + "]" * depth
        raw = f'{{"model": "tiny", "messages": [{{"role": "user", "content": "hi"}}], "x": {nested}}}'
        response = httpx.post(url, content=raw.encode())
        assert _status(response) == 400, response.text
    _still_serving(torch_proxy)


def test_non_utf8_attribution_header_is_400(torch_proxy: RunningProxy) -> None:
    """A non-UTF-8 x-fulmen-* header: 400."""
    headers = {"x-fulmen-rollout-id": b"r\xff\xfe", "x-fulmen-attempt-id": b"a\xc3"}
    response = httpx.post(f"{torch_proxy.base()}/chat/completions", json=CHAT, headers=headers)
    assert _status(response) == 400
    _still_serving(torch_proxy)


def test_lone_surrogate_is_400(torch_proxy: RunningProxy, attempt: tuple[str, str]) -> None:
    """A lone surrogate (``\\ud800``, or its UTF-8 bytes) in content, in a key, or in a prompt: 400."""
    base = torch_proxy.base(*attempt)
    bodies = [
        (f"{base}/chat/completions", b'{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"a\\ud800"}]}'),
        (f"{base}/chat/completions", b'{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"a","\\udfff":1}]}'),
        (f"{base}/completions", b'{"model":"tiny","max_tokens":2,"prompt":"\\udc00x"}'),
        (f"{base}/chat/completions", b'{"model":"tiny","max_tokens":2,"stream":true,"messages":[{"role":"user","content":"\\ud800"}]}'),
        (f"{base}/chat/completions", b'{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"\\uDBFF"}]}'),
        # its UTF-8 bytes, which json decodes with "surrogatepass"
        (f"{base}/chat/completions", b'{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"\xed\xa0\x80"}]}'),
    ]  # fmt: skip
    for url, raw in bodies:
        response = httpx.post(url, content=raw)
        assert _status(response) == 400, (raw, response.text)
    _still_serving(torch_proxy)


def test_huge_integers_are_400(torch_proxy: RunningProxy, attempt: tuple[str, str]) -> None:
    """``max_tokens`` / ``seed`` beyond 64 bits, attributed or not, streamed or not: 400 naming them."""
    for base in (torch_proxy.base(*attempt), torch_proxy.base()):
        for field in ("max_tokens", "seed", "max_completion_tokens"):
            for stream in (False, True):
                body = {**CHAT, field: 2**64 + 1, "stream": stream}
                response = httpx.post(f"{base}/chat/completions", json=body)
                assert _status(response) == 400, (field, response.text)
                assert response.json()["error"]["param"] == field
    _still_serving(torch_proxy)


def test_falsy_model_is_refused(torch_proxy: RunningProxy) -> None:
    """A present but falsy or non-string ``model`` is a 400, not silently the default model."""
    for model in ("", 0, False, [], {}, None):
        response = httpx.post(f"{torch_proxy.base()}/chat/completions", json={**CHAT, "model": model})
        assert _status(response) == 400, (model, response.text)
        assert response.json()["error"]["param"] == "model"
    body = {k: v for k, v in CHAT.items() if k != "model"}  # absent: the default model
    assert httpx.post(f"{torch_proxy.base()}/chat/completions", json=body).status_code == 200


def test_stop_strings_are_capped(torch_proxy: RunningProxy) -> None:
    """Thousands of stop strings, or one huge one: 400 before any generation."""
    url = f"{torch_proxy.base()}/chat/completions"
    for stop in ([f"s{i}" for i in range(5000)], "x" * 10_000, ["ok", "y" * 10_000]):
        response = httpx.post(url, json={**CHAT, "stop": stop})
        assert _status(response) == 400
        assert response.json()["error"]["param"] == "stop"
    assert httpx.post(url, json={**CHAT, "stop": ["a", "b", "c", "d"]}).status_code == 200


def test_ids_with_a_trailing_newline_are_invalid(torch_proxy: RunningProxy) -> None:
    """Ids ending in a newline (or holding any control character) fail validation everywhere."""
    for bad in ("r1\n", "r1\r\n", "r\x001", "r1\t"):
        with pytest.raises(InvalidInput):
            keys.check_id("rollout_id", bad)
    with pytest.raises(InvalidInput):
        keys.check_experiment("exp\n")
    url = f"{torch_proxy.url}/rollout/r1%0A/attempt/a1%0A/v1/chat/completions"
    assert _status(httpx.post(url, json=CHAT)) == 400
    headers = {"x-fulmen-rollout-id": "r1 x", "x-fulmen-attempt-id": "r1.1"}
    assert _status(httpx.post(f"{torch_proxy.base()}/chat/completions", json=CHAT, headers=headers)) == 400


# --- read timeouts -----------------------------------------------------------------------------------


@pytest.fixture
def quick_timeout_proxy(
    redis_server: EmbeddedRedis, experiment: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RunningProxy]:
    """A proxy (in front of a fake upstream) whose request read timeout is short."""
    monkeypatch.setattr(server, "REQUEST_READ_TIMEOUT_S", 0.5)
    fake = FakeOpenAI()
    fake.start_in_thread()
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=experiment, proxy_backend="openai", upstream_urls=fake.base_url
    )
    yield proxy
    proxy.stop()
    fake.stop()


def _closed_by_server(sock: socket.socket) -> bool:
    """Read until the server closes the connection (True) or 30 s pass (False)."""
    sock.settimeout(30)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connected, nothing sent
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n",  # headers never finished
        b'POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"mo',  # body cut short
    ],
)
def test_half_open_connections_are_closed(quick_timeout_proxy: RunningProxy, sent: bytes) -> None:
    """A client that stops sending its request is disconnected; the proxy keeps serving."""
    with socket.create_connection(("127.0.0.1", quick_timeout_proxy.port)) as sock:
        sock.sendall(sent)
        assert _closed_by_server(sock)
    response = httpx.post(f"{quick_timeout_proxy.base()}/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text


def test_keep_alive_connection_serves_several_requests(quick_timeout_proxy: RunningProxy) -> None:
    """The read timeout does not cut an idle keep-alive connection between two requests."""
    body = json.dumps(CHAT).encode()
    request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    with socket.create_connection(("127.0.0.1", quick_timeout_proxy.port)) as sock:
        sock.settimeout(30)
        for _ in range(2):
            sock.sendall(request)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            time.sleep(1.0)  # idle longer than the read timeout, shorter than the keep-alive
