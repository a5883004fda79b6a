"""A Redis outage (the server killed and started again a few seconds later, same data) is ridden out:
the store's calls wait and go on, and the runner, adapter and watchdog processes stay up and finish
new work afterwards (issue 20, items 1 and 4)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from runner_processes import fulmen_processes, wait_until_ready

from fulmen.records.status import RolloutStatus
from fulmen.settings import CommonSettings
from fulmen.store import RedisStore
from fulmen.store.redis.connection import connect
from fulmen.store.redis.embedded import EmbeddedRedis

OUTAGE_S = 2.0  # how long Redis stays down: several backoff rounds, well inside redis_outage_s


async def _outage(server: EmbeddedRedis) -> None:
    """SIGKILL the server (a crash), wait, start it again on the same port and data folder."""
    server.kill()
    await asyncio.sleep(OUTAGE_S)
    await asyncio.to_thread(server.start)


async def test_store_calls_ride_out_a_redis_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A claim blocked when Redis dies returns the rollout queued after it is back; one log line each way."""
    caplog.set_level(logging.WARNING, logger="fulmen.store.redis.connection")
    with EmbeddedRedis(tmp_path / "redis", port=None) as server:
        client = await connect(CommonSettings(redis_url=server.url, redis_outage_s=30), wait_s=10)
        store = RedisStore(client, "outage")
        try:
            await store.queue.ensure()
            claim = asyncio.create_task(store.queue.dequeue_rollouts("w1", 1, block_s=30))
            await asyncio.sleep(0.3)  # the claim is blocked on the empty queue
            await _outage(server)
            await store.rollouts.enqueue_rollout({"q": 1}, rollout_id="after-outage")
            [claimed] = await asyncio.wait_for(claim, 30)
            assert claimed.rollout.rollout_id == "after-outage"
            outcome = await store.rollouts.update_attempt("after-outage", claimed.attempt.attempt_id, status="succeeded")
            assert outcome == "succeeded"
            [done] = await store.finished.wait_for_rollouts(["after-outage"], timeout_s=10)
            assert done.status is RolloutStatus.SUCCEEDED
        finally:
            await client.aclose()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in messages) == 1, messages
    assert sum("is back after an outage" in m for m in messages) == 1, messages


async def test_a_call_gives_up_after_redis_outage_s(tmp_path: Path) -> None:
    """Past the bound the error surfaces (a service then exits and its supervisor restarts it)."""
    from redis.exceptions import ConnectionError

    with EmbeddedRedis(tmp_path / "redis", port=None) as server:
        client = await connect(CommonSettings(redis_url=server.url, redis_outage_s=0.5), wait_s=10)
        try:
            server.kill()
            with pytest.raises(ConnectionError):
                await client.ping()
        finally:
            await client.aclose()


@pytest.mark.slow
async def test_runner_adapter_and_watchdog_stay_up_through_a_redis_restart(tmp_path: Path) -> None:
    """Real processes: work queued after the restart succeeds and is adapted; no process exited."""
    with EmbeddedRedis(tmp_path / "redis", port=None) as server:
        client = await connect(CommonSettings(redis_url=server.url, redis_outage_s=30), wait_s=10)
        store = RedisStore(client, "outage-procs")
        (tmp_path / "logs").mkdir()
        try:
            async with fulmen_processes(tmp_path / "logs", server.url, "outage-procs") as procs:
                runner = await procs.runner("runner_test_agents:noop", "--concurrency", "4")
                adapter = await procs.start("adapter")
                watchdog = await procs.start("watchdog")
                await wait_until_ready(store, runner)
                before = [f"before-{i}" for i in range(10)]
                await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout({"i": i}, rollout_id=r) for i, r in enumerate(before)])
                assert len(await store.finished.wait_for_rollouts(before, timeout_s=60)) == len(before)

                await _outage(server)

                after = [f"after-{i}" for i in range(10)]
                await store.rollouts.enqueue_rollouts([store.rollouts.new_rollout({"i": i}, rollout_id=r) for i, r in enumerate(after)])
                finished = await store.finished.wait_for_rollouts(after, timeout_s=60)
                assert [r.status for r in finished] == [RolloutStatus.SUCCEEDED] * len(after)
                for _ in range(600):  # the adapter takes each finished rollout in turn
                    if (await store.samples.adapter_stats()).get("rollouts", 0) >= len(before) + len(after):
                        break
                    await asyncio.sleep(0.1)
                assert (await store.samples.adapter_stats()).get("rollouts", 0) >= len(before) + len(after)
                for process, name in ((runner, "runner"), (adapter, "adapter"), (watchdog, "watchdog")):
                    # A process logs "is back" on its first command that succeeds after the restart:
                    # the watchdog's next sweep may come after the work above is already done.
                    for _ in range(200):
                        if "is back after an outage" in process.stderr or process.process.returncode is not None:
                            break
                        await asyncio.sleep(0.1)
                    assert process.process.returncode is None, f"{name} exited: {process.stderr[-3000:]}"
                    assert "is back after an outage" in process.stderr, f"{name}: {process.stderr[-3000:]}"
        finally:
            await client.aclose()
