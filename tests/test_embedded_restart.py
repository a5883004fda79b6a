"""The embedded Redis survives a crash: AOF on loopback, and after SIGKILL and a restart every rollout
written two seconds before the kill is there, in the state it had then or a later one."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from restart_checks import assert_back_as_before, kill_while_enqueuing, move_on

from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis


def _non_loopback_address() -> str | None:
    """An address of this machine other than loopback (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


async def test_embedded_redis_is_durable_and_loopback_only(redis_server: EmbeddedRedis) -> None:
    """The embedded server appends every write to an AOF fsynced each second and listens on loopback only."""
    client = aioredis.from_url(redis_server.url, decode_responses=True)
    try:
        config = {}
        names = (
            "appendonly",
            "appendfsync",
            "appendfilename",
            "auto-aof-rewrite-min-size",
            "auto-aof-rewrite-percentage",
            "rdbcompression",
            "bind",
            "protected-mode",
        )
        for name in (*names, "save", "dir"):
            config |= await client.config_get(name)
        await client.set("aof-probe", "1")
    finally:
        await client.aclose()
    assert config == {
        "appendonly": "yes",
        "appendfsync": "everysec",
        "appendfilename": "fulmen.aof",
        # the safety net only: fulmen.store.redis.aof starts rewrites between model versions
        "auto-aof-rewrite-min-size": str(2 * 1024 * 1024 * 1024),
        "auto-aof-rewrite-percentage": "300",
        "rdbcompression": "no",  # weights do not compress; LZF made each AOF rewrite several times slower
        "bind": "127.0.0.1",
        "protected-mode": "yes",
        "save": "",
        "dir": str(redis_server.data_dir),
    }
    assert b"aof-probe" in (redis_server.data_dir / "fulmen.aof").read_bytes()
    address = _non_loopback_address()
    if address is not None:
        with pytest.raises(OSError):
            socket.create_connection((address, redis_server.port), timeout=1).close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[EmbeddedRedis]]:
    """Embedded servers the test starts; every one is stopped after it."""
    started: list[EmbeddedRedis] = []
    yield started
    for server in started:
        server.stop()


@pytest.mark.slow
async def test_rollouts_survive_sigkill_and_restart(tmp_path: Path, servers: list[EmbeddedRedis]) -> None:
    """After SIGKILL and a restart on the same data, every rollout written 2 s before is back, no older."""
    data_dir = tmp_path / "redis"
    servers.append(EmbeddedRedis(data_dir, port=None).start())
    client = aioredis.from_url(servers[0].url)
    store = RedisStore(client, "restart")

    # Wave 1, then moved on: claimed (preparing), heartbeating (running), succeeded, cancelled.
    wave1 = [f"a{i:03d}" for i in range(120)]
    claimed = await move_on(store, wave1, claimed=60, running=40, succeeded=20, cancelled=10)
    snapshot = {r.rollout_id: r.status for r in await store.rollouts.query_rollouts()}
    snapshot_at = time.monotonic()
    assert sorted(snapshot.values()) == sorted(
        [RolloutStatus.SUCCEEDED] * 20
        + [RolloutStatus.RUNNING] * 20
        + [RolloutStatus.PREPARING] * 20
        + [RolloutStatus.QUEUING] * 50
        + [RolloutStatus.CANCELLED] * 10
    )

    # Wave 2, within the last 2 s: more rollouts, and wave 1 moved on again.
    later: dict[str, RolloutStatus] = {}
    for c in claimed[20:40]:
        await store.rollouts.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status="failed")
        later[c.rollout.rollout_id] = RolloutStatus.FAILED
    for c in claimed[40:60]:
        await store.spans.heartbeat(c.rollout.rollout_id, c.attempt.attempt_id)
        later[c.rollout.rollout_id] = RolloutStatus.RUNNING
    for c in await store.queue.dequeue_rollouts("w2", 20):
        later[c.rollout.rollout_id] = RolloutStatus.PREPARING
    wave2 = [f"b{i:03d}" for i in range(100)]
    await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout(i, rollout_id=i) for i in wave2])

    # Wave 3 is still being written when the server dies.
    await kill_while_enqueuing(store, snapshot_at, servers[0].kill, (RedisConnectionError,))
    await client.aclose()
    assert servers[0].process is not None and servers[0].process.returncode == -9

    servers.append(EmbeddedRedis(data_dir, port=servers[0].port).start())
    client = aioredis.from_url(servers[1].url)
    store = RedisStore(client, "restart")
    try:
        # Everything from 2 s before the kill is there, as it was then or as moved on since.
        await assert_back_as_before(store, snapshot, later)
    finally:
        await client.aclose()
