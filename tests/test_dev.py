"""`fulmen.cli.dev`: .env read as honcho reads it, and the run's end (or a failure) stopping every service."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from fulmen.cli import dev
from fulmen.cli import watchdog as watchdog_cli


def test_dotenv_fills_in_what_the_environment_does_not_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Comments and blank lines are skipped, quotes dropped; a variable already set wins."""
    (tmp_path / ".env").write_text("# the demo\n\nDEV_TEST_A=1\nDEV_TEST_B='two'\nDEV_TEST_C=from-file\n")
    monkeypatch.setenv("DEV_TEST_C", "from-shell")
    for name in ("DEV_TEST_A", "DEV_TEST_B"):
        monkeypatch.delenv(name, raising=False)
    dev.apply_dotenv(tmp_path / ".env")
    assert (os.environ["DEV_TEST_A"], os.environ["DEV_TEST_B"], os.environ["DEV_TEST_C"]) == ("1", "two", "from-shell")


async def test_the_runs_end_stops_every_service() -> None:
    """When the algorithm returns, every other service sees stop and ends; exit code 0."""
    stopped: list[str] = []

    async def service(stop: asyncio.Event) -> None:
        await stop.wait()
        stopped.append("service")

    async def algorithm(stop: asyncio.Event) -> None:
        await asyncio.sleep(0)

    assert await dev.run_all({"runner": service, "adapter": service, "algorithm": algorithm}) == 0
    assert stopped == ["service", "service"]


async def test_a_finished_run_stops_the_runners_before_the_rest(redis_url: str, monkeypatch) -> None:
    """At the run's end the runners stop first (finishing what they hold), the adapter after: the
    rollouts the last runner finished still become samples."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    stopped: list[str] = []

    def service(name: str):
        async def main(stop: asyncio.Event) -> None:
            await stop.wait()
            stopped.append(name)
        return main

    async def algorithm(stop: asyncio.Event) -> None:
        await asyncio.sleep(0)

    services = {"adapter": service("adapter"), "runner": service("runner"), "trainer": service("trainer"),
                "algorithm": algorithm}
    assert await dev.run_all(services) == 0
    assert stopped[0] == "runner" and sorted(stopped[1:]) == ["adapter", "trainer"]


async def test_a_failing_service_stops_the_others_with_code_1() -> None:
    """A service that raises ends the run: the others are stopped, the exit code is 1."""
    stopped: list[str] = []

    async def service(stop: asyncio.Event) -> None:
        await stop.wait()
        stopped.append("service")

    async def broken(stop: asyncio.Event) -> None:
        raise RuntimeError("boom")

    assert await dev.run_all({"runner": service, "trainer": broken, "algorithm": service}) == 1
    assert stopped == ["service", "service"]


async def test_the_dev_watchdog_trims_by_the_retention_settings(
    real_store, redis_url: str, experiment: str, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """`fulmen dev`'s watchdog reads the same retention settings as `fulmen watchdog`: an
    acknowledged finished entry goes, the unacknowledged one stays."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("FULMEN_EXPERIMENT", experiment)
    monkeypatch.setenv("FULMEN_RETENTION_MAX_COUNT", "0")
    store = real_store
    await store.finished.ensure_finished_group("adapter")
    for rid in ("a", "b"):
        await store.rollouts.enqueue_rollout({}, rollout_id=rid)
    for c in await store.queue.dequeue_rollouts("w", 2):
        await store.rollouts.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status="succeeded")
    a, _ = await store.finished.read_finished("adapter", "x", count=2)
    await store.finished.ack_finished("adapter", [a.entry_id])
    stop = asyncio.Event()
    task = asyncio.create_task(dev.as_task(watchdog_cli.SERVICE)(stop))
    try:
        for _ in range(500):
            if int(await store.redis.xlen(store.keys.finished)) == 1:
                break
            await asyncio.sleep(0.02)
        assert int(await store.redis.xlen(store.keys.finished)) == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
