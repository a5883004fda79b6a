"""An agent whose proxy is unreachable fails for the infrastructure, not on its merits: the runner waits
for the proxy (up to proxy_retry_s) and runs the rollout again without spending its max_attempts;
a proxy gone for good fails the rollout, naming the proxy."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from fulmen.records.status import AttemptStatus, RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import free_port

COMPLETION = {
    "id": "c1", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "2"}}],
}


async def _chat(_: web.Request) -> web.Response:
    return web.json_response(COMPLETION)


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "x"}]})


async def _ready(_: web.Request) -> web.Response:
    return web.json_response({"ready": True})


@pytest.fixture
async def late_proxy() -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A port nothing listens on, and an event that starts an OpenAI-compatible server there."""
    port = free_port()
    start = asyncio.Event()
    app = web.Application()
    app.router.add_get("/readyz", _ready)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/rollout/{rid}/attempt/{aid}/v1/chat/completions", _chat)
    runner = web.AppRunner(app)

    async def serve_when_asked() -> None:
        await start.wait()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    serving = asyncio.create_task(serve_when_asked())
    yield f"http://127.0.0.1:{port}", start
    serving.cancel()
    await runner.cleanup()


async def _wait_for_log(caplog: pytest.LogCaptureFixture, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, f"never logged {text!r}"
        await asyncio.sleep(0.05)


async def test_a_proxy_back_after_an_outage_runs_the_rollout_again(
    real_store: RedisStore, start_runner, late_proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused, then back: the rollout (max_attempts=1) succeeds on a second attempt; the first names the proxy."""
    caplog.set_level(logging.WARNING, logger="fulmen_runner.execute")
    url, start = late_proxy
    r = await real_store.rollouts.enqueue_rollout({"q": 1})
    assert r.config.max_attempts == 1
    await start_runner("calls_llm", llm_base_url=f"{url}/v1", proxy_retry_s=60)
    await _wait_for_log(caplog, "waiting up to")  # the attempt found the proxy unreachable
    start.set()
    [done] = await real_store.finished.wait_for_rollouts([r.rollout_id], timeout_s=60)
    attempts = await real_store.rollouts.query_attempts(r.rollout_id)
    print("attempts:", [(a.status.value, (a.error or {}).get("message")) for a in attempts])
    assert done.status is RolloutStatus.SUCCEEDED
    assert [a.status for a in attempts] == [AttemptStatus.FAILED, AttemptStatus.SUCCEEDED]
    assert f"proxy {url} unreachable" in attempts[0].error["message"]
    assert (await real_store.rollouts.get_rollout(r.rollout_id)).reward == 1.0


async def test_a_proxy_gone_for_good_fails_the_rollout_after_the_bound(real_store: RedisStore, start_runner) -> None:
    """Nothing ever listens: after proxy_retry_s the rollout fails, the error naming the proxy and the bound."""
    url = f"http://127.0.0.1:{free_port()}"
    r = await real_store.rollouts.enqueue_rollout({"q": 1}, config={"max_attempts": 3, "retry_condition": ["failed"]})
    await start_runner("calls_llm", llm_base_url=f"{url}/v1", proxy_retry_s=1.5)
    [done] = await real_store.finished.wait_for_rollouts([r.rollout_id], timeout_s=60)
    attempts = await real_store.rollouts.query_attempts(r.rollout_id)
    print("attempts:", [(a.status.value, (a.error or {}).get("message")) for a in attempts])
    assert done.status is RolloutStatus.FAILED
    assert len(attempts) == 1  # never re-run: the proxy never answered, and the agent never failed
    message = attempts[0].error["message"]
    assert f"proxy {url} unreachable" in message and "proxy_retry_s=1.5" in message, message


async def test_a_runner_stopping_while_it_waits_hands_the_rollout_back(
    real_store: RedisStore, start_runner, late_proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM during the wait: the rollout is requeued with the outage's start, and the next runner runs it."""
    caplog.set_level(logging.WARNING, logger="fulmen_runner.execute")
    url, start = late_proxy
    r = await real_store.rollouts.enqueue_rollout({"q": 1})
    first = await start_runner("calls_llm", llm_base_url=f"{url}/v1", proxy_retry_s=60, grace_s=0)
    await _wait_for_log(caplog, "waiting up to")
    first.stop()
    while (await real_store.rollouts.get_rollout(r.rollout_id)).status is not RolloutStatus.REQUEUING:
        await asyncio.sleep(0.05)
    handed_back = await real_store.rollouts.get_attempt(f"{r.rollout_id}.1")
    assert handed_back.error["type"] == "ProxyUnreachable" and handed_back.error["unreachable_since"] > 0
    start.set()
    await start_runner("calls_llm", llm_base_url=f"{url}/v1", proxy_retry_s=60)
    [done] = await real_store.finished.wait_for_rollouts([r.rollout_id], timeout_s=60)
    assert done.status is RolloutStatus.SUCCEEDED


async def test_a_proxy_waiting_for_its_version_is_waited_for_too(
    real_store: RedisStore, start_runner, caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy that runs but answers 503 waiting_for_version (its weights are being rebuilt) is an
    infrastructure fault: the rollout (max_attempts=1) is run again once its /readyz answers, and succeeds."""
    caplog.set_level(logging.WARNING, logger="fulmen_runner.execute")
    rebuilt = asyncio.Event()
    waiting = {"error": {"message": "waiting for model version v2", "type": "server_error", "param": None,
                         "code": "waiting_for_version"}}

    async def chat(request: web.Request) -> web.Response:
        return web.json_response(COMPLETION) if rebuilt.is_set() else web.json_response(waiting, status=503)

    async def ready(_: web.Request) -> web.Response:
        return web.json_response({"ready": rebuilt.is_set()}, status=200 if rebuilt.is_set() else 503)

    app = web.Application()
    app.router.add_get("/readyz", ready)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/rollout/{rid}/attempt/{aid}/v1/chat/completions", chat)
    server = web.AppRunner(app)
    await server.setup()
    port = free_port()
    await web.TCPSite(server, "127.0.0.1", port).start()
    try:
        r = await real_store.rollouts.enqueue_rollout({"q": 1})
        await start_runner("calls_llm", llm_base_url=f"http://127.0.0.1:{port}/v1", proxy_retry_s=60)
        await _wait_for_log(caplog, "waiting up to")
        rebuilt.set()
        [done] = await real_store.finished.wait_for_rollouts([r.rollout_id], timeout_s=60)
        attempts = await real_store.rollouts.query_attempts(r.rollout_id)
        print("attempts:", [(a.status.value, (a.error or {}).get("message")) for a in attempts])
        assert done.status is RolloutStatus.SUCCEEDED
        assert [a.status for a in attempts] == [AttemptStatus.FAILED, AttemptStatus.SUCCEEDED]
        assert "unavailable (waiting_for_version" in attempts[0].error["message"]
    finally:
        await server.cleanup()
