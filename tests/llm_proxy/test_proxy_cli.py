"""`fulmen llm-proxy` as a real process: starts, registers, serves, stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from fakes.fake_openai import FakeOpenAI

from fulmen.store import RedisStore


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI(vllm=True)
    fake.start_in_thread()
    yield fake
    fake.stop()


@pytest.mark.slow
async def test_command_serves_registers_and_stops_on_sigterm(
    fake: FakeOpenAI, redis_url: str, experiment: str, real_store: RedisStore
) -> None:
    """The command serves on the port it registers, and SIGTERM exits 0 and unregisters it."""
    env = {**os.environ, "REDIS_URL": redis_url, "FULMEN_EXPERIMENT": experiment}
    env = {k: v for k, v in env.items() if not k.startswith("FULMEN_") or k == "FULMEN_EXPERIMENT"}
    command = [sys.executable, "-c", "from fulmen.cli.main import main; main()", "llm-proxy"]
    args = ["--backend", "vllm", "--upstream-urls", fake.base_url, "--port", "0", "--log-level", "WARNING"]
    process = subprocess.Popen([*command, *args], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (proxies := await real_store.registry.query_proxies()):
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        base_url = proxies[0].base_url
        async with httpx.AsyncClient(base_url=base_url) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200 and response.json()["choices"][0]["token_ids"]
            assert (await client.get("/readyz")).status_code == 200
            assert b"fulmen_proxy_requests_total" in (await client.get("/metrics")).content
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
        assert await real_store.registry.query_proxies() == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
