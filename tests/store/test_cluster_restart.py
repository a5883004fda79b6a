"""A Redis Cluster node survives a crash as the embedded server does (tests/test_embedded_restart.py):
after SIGKILL and a restart from its AOF, every rollout written two seconds before the kill is there,
in the state it had then or a later one, and its queue's consumer group hands out exactly what is
queuing. The other masters keep serving their experiments meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import RedisError
from redis_cluster import EmbeddedCluster
from restart_checks import assert_back_as_before, kill_while_enqueuing, move_on

from fulmen import keys as k
from fulmen.records.status import RolloutStatus
from fulmen.store import RedisStore
from fulmen.store.redis.connection import async_client


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmbeddedCluster]:
    """A cluster of its own: this test kills one of its nodes."""
    with EmbeddedCluster(tmp_path / "cluster", masters=3) as started:
        yield started


def _experiment_on(cluster: EmbeddedCluster, node: int, avoid: int | None = None) -> str:
    """An experiment name whose slot is on master ``node``."""
    for i in range(10_000):
        name = f"restart-{i}"
        if cluster.node_of_key(k.experiment_prefix(name)) == node:
            return name
    raise AssertionError(f"no experiment name lands on node {node}")


@pytest.mark.slow
async def test_rollouts_survive_sigkill_of_a_cluster_node(cluster: EmbeddedCluster) -> None:
    victim, bystander = 0, 1
    name, other = _experiment_on(cluster, victim), _experiment_on(cluster, bystander)
    client = async_client(cluster.url)
    store, other_store = RedisStore(client, name), RedisStore(client, other)

    ids = [f"a{i:03d}" for i in range(90)]
    await other_store.rollouts.enqueue_rollouts([other_store.rollouts.new_rollout(i, rollout_id=i) for i in ids[:10]])
    claimed = await move_on(store, ids, claimed=40, running=30, succeeded=15, cancelled=5)
    snapshot = {r.rollout_id: r.status for r in await store.rollouts.query_rollouts()}
    snapshot_at = time.monotonic()
    assert sorted(snapshot.values()) == sorted(
        [RolloutStatus.SUCCEEDED] * 15 + [RolloutStatus.RUNNING] * 15 + [RolloutStatus.PREPARING] * 10
        + [RolloutStatus.QUEUING] * 45 + [RolloutStatus.CANCELLED] * 5
    )
    later: dict[str, RolloutStatus] = {}
    for c in claimed[15:25]:
        await store.rollouts.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status="failed")
        later[c.rollout.rollout_id] = RolloutStatus.FAILED
    await kill_while_enqueuing(store, snapshot_at, lambda: cluster.kill(victim), (RedisError,))
    # The writer's last enqueue may already be on the store's auto-pipeline, whose own task goes on
    # retrying after the writer is cancelled: let it fail against the dead node, or it may land after
    # the restart, between the reads below (a late write, not a lost or torn one).
    await asyncio.gather(*store.ctx.pipeline._in_flight, return_exceptions=True)
    await client.aclose()

    cluster.start_node(victim)
    cluster.wait_ok()
    client = async_client(cluster.url)
    store, other_store = RedisStore(client, name), RedisStore(client, other)
    try:
        await assert_back_as_before(store, snapshot, later)
        # The experiment on another master was never touched by the crash.
        assert sorted(r.rollout_id for r in await other_store.rollouts.query_rollouts(status="queuing")) == ids[:10]
    finally:
        await client.aclose()
