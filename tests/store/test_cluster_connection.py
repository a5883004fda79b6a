"""Which client a Redis URL gives: a cluster URL (redis+cluster://h:p[,h:p]) or the plain URL of a
node in cluster mode gives redis-py's cluster client; a single node's URL the plain client, as before."""

from __future__ import annotations

import pytest
import redis
from redis_cluster import EmbeddedCluster

from fulmen.settings import CommonSettings
from fulmen.store import RedisStore
from fulmen.store.redis.connection import OutageCluster, cluster_options, connect, sync_client
from fulmen.store.redis.embedded import EmbeddedRedis


def test_cluster_url_names_nodes_and_credentials() -> None:
    options = cluster_options("rediss+cluster://app:p%40ss@10.0.0.1:7000, 10.0.0.2:7001/0")
    assert options == {"ssl": True, "username": "app", "password": "p@ss",
                       "nodes": [("10.0.0.1", 7000), ("10.0.0.2", 7001)]}
    assert cluster_options("redis+cluster://[::1]:7000")["nodes"] == [("::1", 7000)]


@pytest.mark.parametrize("url", ["redis+cluster://", "redis+cluster://host", "redis+cluster://h:port",
                                 "redis://h:1"])
def test_a_bad_cluster_url_is_a_clear_error(url: str) -> None:
    with pytest.raises(ValueError, match="cluster"):
        cluster_options(url)


@pytest.mark.parametrize("form", ["cluster-url", "plain-url-of-a-node"])
async def test_a_cluster_gets_the_cluster_client(redis_cluster: EmbeddedCluster, form: str) -> None:
    url = redis_cluster.url if form == "cluster-url" else f"redis://127.0.0.1:{redis_cluster.ports[1]}"
    client = await connect(CommonSettings(redis_url=url), wait_s=10)
    try:
        assert isinstance(client, OutageCluster) and client.outage is not None
        store = RedisStore(client, f"conn-{form}")
        await store.rollouts.enqueue_rollout({"q": 1}, rollout_id="r1")
        claimed = await store.queue.dequeue_rollout("w")
        assert claimed is not None and claimed.rollout.rollout_id == "r1"
    finally:
        await client.aclose()
    sync = sync_client(url)
    try:
        assert isinstance(sync, redis.RedisCluster)
    finally:
        sync.close()


async def test_a_single_node_keeps_the_plain_client(redis_server: EmbeddedRedis) -> None:
    client = await connect(CommonSettings(redis_url=redis_server.url), wait_s=10)
    try:
        assert not isinstance(client, OutageCluster)
        assert await client.ping()
    finally:
        await client.aclose()
    sync = sync_client(redis_server.url)
    try:
        assert type(sync) is redis.Redis
    finally:
        sync.close()
