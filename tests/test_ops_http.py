"""The ops server: /healthz, /readyz (503 with the reason) and /metrics, its port, its heartbeat."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import redis

from fulmen import keys as k
from fulmen.records import ServiceBeat
from fulmen.settings import load_settings
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import free_port
from fulmen.telemetry.http import OpsServer, ops_port


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def test_ready_only_once_the_consumer_group_exists(real_store: RedisStore, redis_url: str) -> None:
    """Group missing: 503 naming it; created: 200. /healthz is 200 throughout; /metrics has both kinds."""
    settings = load_settings(redis_url=redis_url, experiment=real_store.experiment)
    with OpsServer(settings, "runner", groups=[("queue", k.RUNNERS_GROUP)], port=0) as ops:
        assert ops.port
        assert _get(ops.port, "/healthz") == (200, '{"status":"ok"}')
        status, body = _get(ops.port, "/readyz")
        assert status == 503
        reason = json.loads(body)["reason"]
        assert "'runners'" in reason and "missing" in reason
        await real_store.queue.ensure()  # creates the queue's group
        assert _get(ops.port, "/readyz") == (200, '{"ready": true}')
        status, text = _get(ops.port, "/metrics")
        assert status == 200
        assert "fulmen_queue_depth 0.0" in text and "process_cpu_seconds_total" in text
        assert _get(ops.port, "/nope")[0] == 404
        beats = await real_store.redis.hgetall(real_store.keys.services)
        (beat,) = [ServiceBeat.from_wire(v) for v in beats.values()]
        assert beat.service == "runner" and beat.port == ops.port
    assert await real_store.redis.hlen(real_store.keys.services) == 0  # a clean stop leaves no ghost


def test_not_ready_when_redis_is_unreachable() -> None:
    """Nothing listens at REDIS_URL: /readyz is 503 with the reason (no password in it), /healthz 200."""
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    settings = load_settings(redis_url=url)
    with OpsServer(settings, "adapter", groups=[("finished", k.ADAPTER_GROUP)], port=0) as ops:
        assert _get(ops.port, "/healthz")[0] == 200
        status, body = _get(ops.port, "/readyz")
        assert status == 503
        assert json.loads(body)["reason"].startswith("redis unreachable")
        assert "s3cret" not in body
        status, text = _get(ops.port, "/metrics")
        assert status == 200 and "fulmen_redis_up 0.0" in text and "s3cret" not in text


def test_port_setting_then_honcho_port_then_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """FULMEN_METRICS_PORT wins; else $PORT (one per process under honcho); else no server."""
    monkeypatch.delenv("PORT", raising=False)
    monkeypatch.delenv("FULMEN_METRICS_PORT", raising=False)
    assert ops_port(load_settings()) is None
    monkeypatch.setenv("PORT", "5100")
    assert ops_port(load_settings()) == 5100
    assert ops_port(load_settings(metrics_port=9100)) == 9100


def test_no_port_no_server_but_a_heartbeat(redis_url: str) -> None:
    """Without a port nothing listens, yet the service still shows up for `fulmen top`."""
    settings = load_settings(redis_url=redis_url, experiment="t-noport")
    client = redis.Redis.from_url(redis_url)
    try:
        with OpsServer(settings, "watchdog") as ops:
            assert ops.port is None
            for _ in range(50):
                if client.hlen(k.Keys("t-noport").services):
                    break
                time.sleep(0.05)
            assert client.hlen(k.Keys("t-noport").services) == 1
    finally:
        client.close()
