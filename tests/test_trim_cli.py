"""`fulmen trim` by hand (a dry run prints what would go and removes nothing), and the watchdog's
retention schedule from its settings (off unless a limit is set)."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

from fulmen.cli.main import app
from fulmen.cli.trim import retention_schedule
from fulmen.errors import InvalidInput
from fulmen.settings import WatchdogSettings, known_env_names
from fulmen.store import RedisStore
from fulmen.store.redis.connection import async_client

runner = CliRunner()


def test_retention_is_off_by_default_and_runs_once_a_limit_is_set() -> None:
    """No limit: no schedule. A limit: every 300 s unless the interval is set. An interval with no
    limit is an error, not a loop that trims nothing."""
    assert retention_schedule(WatchdogSettings()) is None
    schedule = retention_schedule(WatchdogSettings(retention_max_age_s=3600, retention_dead_letters_max_age_s=60))
    assert schedule is not None and schedule.interval_s == 300
    assert (schedule.policy.max_age_s, schedule.policy.dead_letters_max_age_s) == (3600, 60)
    assert retention_schedule(WatchdogSettings(retention_keep_versions=2, retention_interval_s=5)).interval_s == 5
    with pytest.raises(InvalidInput):
        retention_schedule(WatchdogSettings(retention_interval_s=5))
    with pytest.raises(InvalidInput):
        retention_schedule(WatchdogSettings(retention_resources=True))  # the log needs an age or a count
    assert "FULMEN_RETENTION_MAX_AGE_S" in known_env_names()


async def _two_queued_one_claimed(url: str, experiment: str) -> None:
    client = async_client(url)
    store = RedisStore(client, experiment)
    for rid in ("a", "b"):
        await store.rollouts.enqueue_rollout({}, rollout_id=rid)
    await store.queue.dequeue_rollouts("w", 1)
    await client.aclose()


async def _queue_length(url: str, experiment: str) -> int:
    client = async_client(url)
    length = int(await client.xlen(RedisStore(client, experiment).keys.queue))
    await client.aclose()
    return length


def test_trim_dry_run_prints_what_would_go_then_trim_removes_it(
    redis_url: str, experiment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--dry-run` names each stream with what would go and removes nothing; the trim then removes
    exactly that; a trim with nothing to do by is refused (exit 2)."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("FULMEN_EXPERIMENT", experiment)
    asyncio.run(_two_queued_one_claimed(redis_url, experiment))

    dry = runner.invoke(app, ["trim", "--max-count", "0", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert f"queue  fulmen:{{{experiment}}}:queue: would trim 1" in dry.stdout
    assert "would trim 1 queue entries" in dry.stdout
    assert asyncio.run(_queue_length(redis_url, experiment)) == 2

    real = runner.invoke(app, ["trim", "--max-count", "0", "--no-finished", "--no-samples"])
    assert real.exit_code == 0, real.output
    assert "trimmed 1 queue entries" in real.stdout and ":finished" not in real.stdout
    assert asyncio.run(_queue_length(redis_url, experiment)) == 1

    refused = runner.invoke(app, ["trim"])
    assert refused.exit_code == 2 and "needs max_age_s or max_count" in refused.output
