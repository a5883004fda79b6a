"""Upstream retries, rate limit and response cache, against a flaky fake upstream on loopback.

Attempt counts are exact; times are bounded generously (the machine is shared), but tightly enough
that the wrong wait (backoff instead of Retry-After, none at all) fails."""

from __future__ import annotations

import email.utils
import itertools
import json
import time
from collections.abc import Iterator

import openai
import pytest
from flaky_upstream import FlakyUpstream
from proxy_helpers import RunningProxy

from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen_llm_proxy.backends.upstream.cache import ResponseCache, request_key
from fulmen_llm_proxy.backends.upstream.policy import UpstreamPolicy, retry_after
from fulmen_llm_proxy.backends.upstream.rate_limit import RateLimiter, TokenBucket
from fulmen_llm_proxy.backends.upstream.upstreams import Upstreams
from fulmen_llm_proxy.errors import ProxyError

PATH = "/v1/chat/completions"
BODY = {"model": "up-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PAYLOAD = json.dumps(BODY).encode()


@pytest.fixture(scope="module")
def upstream() -> Iterator[FlakyUpstream]:
    up = FlakyUpstream().start()
    yield up
    up.stop()


def gaps(up: FlakyUpstream) -> list[float]:
    times = [t for t, _, _ in up.requests]
    return [b - a for a, b in itertools.pairwise(times)]


async def post(up: FlakyUpstream, **policy: object) -> dict:
    upstreams = Upstreams([up.url], policy=UpstreamPolicy(**policy))  # type: ignore[arg-type]
    try:
        return await upstreams.post_json(PATH, PAYLOAD, "")
    finally:
        await upstreams.close()


async def test_429_waits_what_retry_after_says_not_the_backoff(upstream: FlakyUpstream) -> None:
    upstream.script({"status": 429, "headers": {"Retry-After": "1"}})
    body = await post(upstream, backoff_s=10.0)  # a backoff would wait 5-10 s
    assert body["choices"][0]["message"]["content"] == "ok"
    assert len(upstream.requests) == 2
    assert 0.95 <= gaps(upstream)[0] < 3.0


async def test_5xx_retried_with_growing_jittered_backoff(upstream: FlakyUpstream) -> None:
    upstream.script({"status": 500}, {"status": 503})
    await post(upstream, backoff_s=0.2, max_attempts=3)
    assert len(upstream.requests) == 3
    first, second = gaps(upstream)
    assert 0.1 <= first < 1.5 and 0.2 <= second < 2.0  # uniform in [b/2, b] for b = 0.2, then 0.4


async def test_attempts_are_bounded_and_the_last_error_is_returned(upstream: FlakyUpstream) -> None:
    upstream.script(*[{"status": 500}] * 5)
    with pytest.raises(ProxyError) as caught:
        await post(upstream, backoff_s=0.01, max_attempts=3)
    assert caught.value.status == 502 and len(upstream.requests) == 3
    upstream.script({"status": 400}, {"status": 500})
    with pytest.raises(ProxyError) as caught:
        await post(upstream, backoff_s=0.01)
    assert caught.value.status == 400 and len(upstream.requests) == 1  # a 4xx other than 429: not retried


async def test_a_connection_broken_mid_reply_is_retried(upstream: FlakyUpstream) -> None:
    upstream.script({"break": True})
    body = await post(upstream, backoff_s=0.01)
    assert body["choices"][0]["message"]["content"] == "ok" and len(upstream.requests) == 2
    upstream.script(*[{"break": True}] * 3)
    with pytest.raises(ProxyError) as caught:
        await post(upstream, backoff_s=0.01)
    assert caught.value.status == 502 and "mid-reply" in caught.value.message and len(upstream.requests) == 3


async def test_a_slow_answer_times_out_and_is_retried(upstream: FlakyUpstream) -> None:
    upstream.script({"delay_s": 3.0})
    started = time.monotonic()
    body = await post(upstream, timeout_s=0.3, backoff_s=0.05)
    assert body["choices"][0]["message"]["content"] == "ok"
    assert len(upstream.requests) == 2 and time.monotonic() - started < 2.0
    upstream.script({"delay_s": 3.0}, {"delay_s": 3.0})
    started = time.monotonic()
    with pytest.raises(ProxyError) as caught:
        await post(upstream, timeout_s=0.3, backoff_s=0.05, max_attempts=2)
    assert caught.value.status == 504 and caught.value.code == "upstream_timeout"
    assert len(upstream.requests) == 2 and time.monotonic() - started < 2.0


async def test_a_wait_past_the_budget_is_not_waited(upstream: FlakyUpstream) -> None:
    upstream.script({"status": 429, "headers": {"retry-after": "30"}})
    started = time.monotonic()
    with pytest.raises(ProxyError) as caught:
        await post(upstream, budget_s=5.0)
    assert caught.value.status == 429 and len(upstream.requests) == 1
    assert time.monotonic() - started < 1.0


async def test_streaming_is_retried_until_its_head_arrives(upstream: FlakyUpstream) -> None:
    upstream.script({"status": 503, "headers": {"retry-after": "0.2"}})
    upstreams = Upstreams([upstream.url], policy=UpstreamPolicy(backoff_s=10.0))
    try:
        events = [e async for e in upstreams.post_sse(PATH, json.dumps({**BODY, "stream": True}).encode(), "")]
    finally:
        await upstreams.close()
    assert events[0]["choices"][0]["delta"]["content"] == "ok"
    assert len(upstream.requests) == 2 and 0.15 <= gaps(upstream)[0] < 2.0


async def test_another_api_sends_its_own_headers_through_the_same_policy(upstream: FlakyUpstream) -> None:
    """An Anthropic-style backend: its key header instead of a bearer one, the same retries."""
    upstream.script({"status": 529})  # Anthropic's "overloaded"
    upstreams = Upstreams([upstream.url], "ignored", headers={"x-api-key": "k1", "anthropic-version": "2023-06-01"},
                          policy=UpstreamPolicy(backoff_s=0.01))  # fmt: skip
    try:
        await upstreams.post_json("/v1/messages", PAYLOAD, "")
    finally:
        await upstreams.close()
    assert len(upstream.requests) == 2 and upstream.requests[0][1] == "/v1/messages"
    assert upstream.headers[0]["x-api-key"] == "k1" and "authorization" not in upstream.headers[0]


def test_retry_after_reads_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0
    assert retry_after(b"2") == 2.0 and retry_after("0.5") == 0.5
    assert retry_after(email.utils.formatdate(now + 7, usegmt=True), now=now) == pytest.approx(7.0)
    assert retry_after(email.utils.formatdate(now - 7, usegmt=True), now=now) == 0.0  # in the past: now
    assert retry_after(b"soon") is None and retry_after(None) is None and retry_after("nan") is None


async def test_rate_limit_spaces_requests_per_minute(upstream: FlakyUpstream) -> None:
    upstream.script()
    upstreams = Upstreams([upstream.url], policy=UpstreamPolicy(requests_per_minute=120))  # burst 12, then 2/s
    try:
        for _ in range(14):
            await upstreams.post_json(PATH, PAYLOAD, "")
    finally:
        await upstreams.close()
    times = [t for t, _, _ in upstream.requests]
    assert len(times) == 14
    assert times[11] - times[0] < 0.4  # the burst went at once
    assert 0.85 <= times[13] - times[0] < 3.0  # then one request per 0.5 s


async def test_tokens_per_minute_reserve_an_estimate_and_settle_by_usage() -> None:
    now = [0.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    limiter = RateLimiter(None, 600, clock=lambda: now[0], sleep=sleep)  # 10 tokens/s, burst 60
    await limiter.acquire(50, deadline=100)  # 60 - 50: 10 left
    assert slept == []
    limiter.settle(50, 10)  # it used 10, not 50: 40 come back, 50 left
    await limiter.acquire(50, deadline=100)  # without the settling this one would wait 4 s
    assert slept == []
    await limiter.acquire(30, deadline=100)  # 30 short, at 10 a second
    assert slept == [pytest.approx(3.0)]
    with pytest.raises(ProxyError) as caught:
        await limiter.acquire(600, deadline=now[0] + 5)
    assert caught.value.status == 429 and caught.value.code == "rate_limit_exceeded"
    await limiter.acquire(10, deadline=now[0] + 5)  # the refused call's reservation was given back
    assert slept[-1] == pytest.approx(1.0)


def test_a_bucket_refills_to_its_burst_only() -> None:
    now = [0.0]
    bucket = TokenBucket(60, clock=lambda: now[0])  # 1 a second, burst 6
    assert [bucket.reserve(1) for _ in range(6)] == [0.0] * 6
    assert bucket.reserve(1) == pytest.approx(1.0)
    now[0] = 1000.0
    assert bucket.level <= 6 and bucket.reserve(6) == 0.0 and bucket.reserve(1) == pytest.approx(1.0)


def test_cache_key_normalises_the_request() -> None:
    base = {**BODY, "temperature": 0}
    key = request_key(PATH, base)
    assert key is not None
    assert request_key(PATH, {**base, "n": 1, "top_p": 1, "user": "u", "seed": None}) == key
    assert request_key(PATH, dict(reversed(list(base.items())))) == key  # key order
    assert request_key(PATH, {**base, "stop": "x"}) == request_key(PATH, {**base, "stop": ["x"]})
    assert request_key(PATH, {**base, "max_tokens": 5}) != key
    assert request_key("/v1/completions", base) != key
    assert request_key(PATH, {**base, "temperature": 0.5}) is None
    assert request_key(PATH, BODY) is None  # no temperature: 1 by default
    assert request_key(PATH, {**base, "stream": True}) is None


def test_cache_is_an_lru_bounded_by_entries() -> None:
    cache = ResponseCache(2)
    for name in "abc":
        cache.put(name, json.dumps({"id": name}).encode())
    assert len(cache) == 2 and cache.get("a") is None
    hit = cache.get("b")
    assert hit is not None and hit["id"].startswith("b-cached-")
    cache.put("d", b"{}")
    assert cache.get("c") is None and cache.get("b") is not None  # b was used last: c went
    small = ResponseCache(10, max_bytes=20)
    small.put("a", b'{"id": "a"}')
    small.put("b", b'{"id": "b"}')  # 22 bytes in all: a goes
    small.put("huge", b"x" * 21)  # larger than the whole bound: never held
    assert small.get("a") is None and small.get("b") is not None and small.get("huge") is None
    assert small.bytes == 11


@pytest.fixture(scope="module")
def cached_proxy(redis_server: EmbeddedRedis, module_experiment: str, upstream: FlakyUpstream) -> Iterator[RunningProxy]:
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=module_experiment, proxy_backend="openai", upstream_urls=upstream.url,
        model_name="up-model", upstream_cache_entries=16, upstream_backoff_s=5.0,
    )  # fmt: skip
    yield proxy
    proxy.stop()


async def test_the_proxy_serves_a_repeated_temperature_0_call_from_its_cache(
    cached_proxy: RunningProxy, upstream: FlakyUpstream, proxy_store: object
) -> None:
    upstream.script()
    messages = [{"role": "user", "content": "what is 2+2?"}]
    answers = []
    for i in range(2):  # two attempts, two idempotency keys: the same question
        started = await proxy_store.rollouts.start_rollout({"task": i}, "w")  # type: ignore[attr-defined]
        client = openai.AsyncOpenAI(
            base_url=cached_proxy.base(started.rollout.rollout_id, started.attempt.attempt_id), api_key="x",
            max_retries=0,
        )  # fmt: skip
        answers.append(await client.chat.completions.create(
            model="up-model", messages=messages, temperature=0, extra_headers={"Idempotency-Key": f"k{i}"}))
        spans = await proxy_store.spans.query_spans(started.rollout.rollout_id)  # type: ignore[attr-defined]
        assert len(spans) == 1  # a cached answer is recorded as any other
    assert len(upstream.requests) == 1
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content == "ok"
    assert answers[0].id != answers[1].id
    client = openai.AsyncOpenAI(base_url=cached_proxy.base(), api_key="x", max_retries=0)
    for _ in range(2):
        await client.chat.completions.create(model="up-model", messages=messages, temperature=0.7)
    assert len(upstream.requests) == 3  # not temperature 0: never cached


async def test_the_proxy_retries_a_429_itself(cached_proxy: RunningProxy, upstream: FlakyUpstream) -> None:
    upstream.script({"status": 429, "headers": {"retry-after": "0.3"}})
    client = openai.AsyncOpenAI(base_url=cached_proxy.base(), api_key="x", max_retries=0)
    response = await client.chat.completions.create(
        model="up-model", messages=[{"role": "user", "content": "retry me"}]
    )
    assert response.choices[0].message.content == "ok"
    assert len(upstream.requests) == 2 and 0.25 <= gaps(upstream)[0] < 3.0
