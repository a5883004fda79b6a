"""Pause / drain / resume on the control stream, and the registry entry that reports them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from fakes.fake_openai import FakeOpenAI
from proxy_helpers import RunningProxy

from fulmen.records import ControlMessage, ProxyEndpoint
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen_llm_proxy.control import send_control

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    fake.start_in_thread()
    yield fake
    fake.stop()


@pytest.fixture
def proxy(redis_server: EmbeddedRedis, experiment: str, fake: FakeOpenAI) -> Iterator[RunningProxy]:
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=experiment, proxy_backend="openai", upstream_urls=fake.base_url
    )
    yield proxy
    proxy.stop()


async def _entry(store: RedisStore, state: str, control_id: str) -> ProxyEndpoint:
    deadline = time.monotonic() + 5
    while True:
        (endpoint,) = await store.registry.query_proxies()
        if endpoint.metadata["state"] == state and endpoint.metadata["control_id"] == control_id:
            return endpoint
        assert time.monotonic() < deadline, endpoint.metadata
        await asyncio.sleep(0.02)


async def test_drain_holds_new_calls_reports_drained_and_resume_releases(
    proxy: RunningProxy, fake: FakeOpenAI, real_store: RedisStore
) -> None:
    """drain: the in-flight call finishes, the registry says drained, new calls wait until resume."""
    fake.script({"content": "slow", "delay_s": 0.4})
    async with httpx.AsyncClient(base_url=proxy.base(), timeout=10) as client:
        slow = asyncio.create_task(client.post("/chat/completions", json=BODY))
        await asyncio.sleep(0.1)
        drain = await send_control(real_store, "drain")
        await _entry(real_store, "draining", drain.control_id)
        assert (await slow).status_code == 200  # in flight when the drain came: served
        await _entry(real_store, "drained", drain.control_id)
        held = asyncio.create_task(client.post("/chat/completions", json=BODY))
        await asyncio.sleep(0.3)
        assert not held.done()
        resume = await send_control(real_store, "resume")
        assert (await held).status_code == 200
        await _entry(real_store, "serving", resume.control_id)


async def test_pause_times_out_by_itself_and_only_for_named_proxies(
    proxy: RunningProxy, real_store: RedisStore
) -> None:
    """A pause for another proxy changes nothing; a pause with timeout_s ends on its own."""
    other = await send_control(real_store, "pause", proxy_ids=("someone-else",))
    await asyncio.sleep(0.2)
    (endpoint,) = await real_store.registry.query_proxies()
    assert endpoint.metadata["state"] == "serving" and endpoint.metadata["control_id"] != other.control_id
    pause = await send_control(real_store, "pause", timeout_s=0.5)
    await _entry(real_store, "paused", pause.control_id)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=proxy.base(), timeout=10) as client:
        assert (await client.post("/chat/completions", json=BODY)).status_code == 200
    assert time.monotonic() - started > 0.2  # it waited for the pause to end


async def test_paused_call_gets_503_after_the_wait(proxy: RunningProxy, real_store: RedisStore) -> None:
    """A call held longer than the gate's wait gets 503 with code 'paused'."""
    proxy.app.service.gate.wait_s = 0.2
    pause = await send_control(real_store, "pause")
    await _entry(real_store, "paused", pause.control_id)
    async with httpx.AsyncClient(base_url=proxy.base(), timeout=10) as client:
        response = await client.post("/chat/completions", json=BODY)
        assert response.status_code == 503 and response.json()["error"]["code"] == "paused"
        assert (await client.get(f"{proxy.url}/healthz")).status_code == 200
    await send_control(real_store, "resume")


async def test_proxy_starting_during_a_pause_starts_paused(
    redis_server: EmbeddedRedis, experiment: str, fake: FakeOpenAI, real_store: RedisStore
) -> None:
    """The latest control message, if still within its timeout, applies to a proxy that starts later."""
    pause = await send_control(real_store, "pause", timeout_s=30)
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=experiment, proxy_backend="openai", upstream_urls=fake.base_url
    )
    try:
        await _entry(real_store, "paused", pause.control_id)
    finally:
        proxy.stop()
    assert await real_store.registry.query_proxies() == []  # unregistered on shutdown


def test_control_record_round_trips() -> None:
    """The control record's wire form decodes to the same message."""
    message = ControlMessage("drain", "c1", ("p1",), 5.0, 123.0)
    assert ControlMessage.from_wire(message.to_wire()) == message
