"""`fulmen status` names the model version each server serves: a vLLM replica's LoRA adapter version
(the replica state vllm-sync writes), a proxy's version, and why a replica is not ready."""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from fulmen.cli import service as service_cli
from fulmen.cli.main import app
from fulmen.records import ProxyEndpoint, ReplicaState
from fulmen.store import RedisStore
from fulmen.store.redis.connection import async_client


@pytest.fixture
def env(redis_url: str, experiment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("FULMEN_EXPERIMENT", experiment)


async def _servers(redis_url: str, experiment: str) -> None:
    client = async_client(redis_url)
    store = RedisStore(client, experiment)
    await store.registry.set_replica(ReplicaState("http://vllm-a:8100", "v3", ready=True, served_model="v3"))
    await store.registry.set_replica(ReplicaState("http://vllm-b:8100", "v2", ready=False, reason="loading v4"))
    await store.registry.register_proxy(ProxyEndpoint("p1", "http://proxy:8000", "tiny", model_version="v3",
                                             metadata={"backend": "torch"}))
    await client.aclose()


def test_status_shows_what_each_server_serves(env: None, redis_url: str, experiment: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA version served as an adapter reads "v3 (LoRA adapter)"; a loading replica says why."""
    asyncio.run(_servers(redis_url, experiment))
    runner = CliRunner()
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["server"]: row for row in json.loads(result.stdout)["served_by"]}
    assert rows["http://vllm-a:8100"]["model_version"] == "v3" and rows["http://vllm-a:8100"]["lora_adapter"]
    assert not rows["http://vllm-b:8100"]["ready"] and rows["http://vllm-b:8100"]["reason"] == "loading v4"
    assert rows["http://proxy:8000"]["model_version"] == "v3"
    # the console's width is read once, when fulmen.cli.service is first imported (80 under xdist): widen it
    monkeypatch.setattr(service_cli.out, "width", 200)
    table = runner.invoke(app, ["status"]).stdout
    assert "http://vllm-a:8100: v3 (LoRA adapter)" in table
    assert "http://vllm-b:8100: v2 — not ready: loading v4" in table
    assert "served by llm-proxy (torch)" in table
