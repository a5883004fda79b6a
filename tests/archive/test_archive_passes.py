"""Archive passes: each writes only what is new (logs after their last archived entry, the state only
when it changed), `archive_every` logs each pass and retries a failed one, and `fulmen archive
--every` exits 0 on SIGTERM after a last pass."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import stop as stop_procs

from fulmen.archive import schedule
from fulmen.archive.files import list_chunks, read_file
from fulmen.archive.restore import restore
from fulmen.archive.write import archive
from fulmen.cli.archive import parse_duration
from fulmen.store import RedisStore
from fulmen.telemetry.steps import append_step, latest_step, summarize


async def _step(store: RedisStore, step: int) -> None:
    await append_step(store.redis, store.keys, summarize(step, {"model_version": f"v{step}", "loss/total": 1.0},
                                                         time.time()))


async def test_each_pass_writes_only_what_is_new(real_store: RedisStore, tmp_path: Path,
                                                 redis_url: str) -> None:
    """A second pass with nothing new writes no file; after a new step, a dead letter and a changed
    algorithm position it writes those three alone; a restore of both passes holds all of it."""
    store = real_store
    await _step(store, 1)
    await store.redis.hset(store.keys.algorithm_state, mapping={"epoch": 0, "cursor": 1})
    first = await archive(store, tmp_path)
    assert first.logs["steps"] == 1 and first.state is not None
    idle = await archive(store, tmp_path)
    assert idle.files == [] and idle.state is None and sum(idle.logs.values()) == 0
    await _step(store, 2)
    await store.dead_letters.dead_letter(store.keys.samples, "1-0", "unreadable", {b"m": b"x"})
    await store.redis.hset(store.keys.algorithm_state, "cursor", 2)
    second = await archive(store, tmp_path)
    print(second.summary())
    assert sorted(p.name.split("-s0-")[0] for p in second.files) == ["dead-letters", "state", "steps"]
    assert second.logs == {"steps": 1, "resources": 0, "validations": 0, "dead-letters": 1}
    [_, steps_file] = [c.path for c in list_chunks(tmp_path, "steps")]
    assert [entry[0] for entry in read_file(steps_file, "steps")[1]] == [
        (await store.redis.xrange(store.keys.trainer_steps))[-1][0].decode()]

    copy = RedisStore(store.redis, store.experiment + "-copy")
    await restore(copy, tmp_path)
    assert await latest_step(copy.redis, copy.keys) == 2
    assert await copy.redis.hgetall(copy.keys.algorithm_state) == {b"epoch": b"0", b"cursor": b"2"}
    assert await copy.redis.xlen(copy.keys.dead_letters) == 1


async def test_trim_keeps_what_the_archive_has_not_written(real_store: RedisStore, tmp_path: Path) -> None:
    """Once `fulmen archive` ran, trimming the steps and the dead letters removes only what its files
    hold: the steps and letters that came after its last pass stay, whatever the limits say."""
    from fulmen.retention.trim import RetentionPolicy, trim

    store = real_store
    for step in (1, 2, 3):
        await _step(store, step)
    await store.dead_letters.dead_letter(store.keys.samples, "1-0", "unreadable", {b"m": b"x"})
    await archive(store, tmp_path)
    for step in (4, 5):
        await _step(store, step)
    await store.dead_letters.dead_letter(store.keys.samples, "2-0", "unreadable", {b"m": b"y"})
    report = await trim(store, RetentionPolicy(steps_max_count=1, dead_letters_max_age_s=0))
    assert (report.steps, report.dead_letters) == (3, 1)
    assert [summary.step for summary in await _steps(store)] == [4, 5]  # steps_max_count=1 would keep 5 only
    assert [d.entry_id for d in await store.dead_letters.query_dead_letters()] == ["2-0"]
    await archive(store, tmp_path)  # now archived: the limits apply
    report = await trim(store, RetentionPolicy(steps_max_count=1, dead_letters_max_age_s=0))
    assert (report.steps, report.dead_letters) == (1, 1)
    assert [summary.step for summary in await _steps(store)] == [5]


async def _steps(store: RedisStore) -> list:
    from fulmen.records import TrainStep

    return [TrainStep.from_wire(fields[b"m"]) for _, fields in await store.redis.xrange(store.keys.trainer_steps)]


async def test_archive_every_retries_a_failed_pass_and_ends_with_a_last_one(
    real_store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A pass that raises a Redis error is logged and tried again (after the short retry wait, not the
    interval); each pass that works logs its counts; once stopped, a last pass archives what came since."""
    calls = 0
    second_done = asyncio.Event()
    real_archive = schedule.archive

    async def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("Redis went away")
        report = await real_archive(*args, **kwargs)
        if calls == 2:
            second_done.set()
        return report

    monkeypatch.setattr(schedule, "archive", flaky)
    await _step(real_store, 1)
    stop = asyncio.Event()
    caplog.set_level(logging.INFO, "fulmen.archive")
    looping = asyncio.create_task(schedule.archive_every(real_store, tmp_path, 3600, stop, retry_s=0.01))
    await asyncio.wait_for(second_done.wait(), 30)
    await _step(real_store, 2)  # after the last pass in the loop: only the last pass on stop takes it
    stop.set()
    assert await asyncio.wait_for(looping, 30) == 2
    assert calls == 3
    text = caplog.text
    print(text)
    assert "archive pass failed, trying again: ConnectionError: Redis went away" in text
    assert "archived 0 rollouts and 0 samples, 1 steps" in text and "1 steps" in text.split("archived")[-1]
    assert len(list_chunks(tmp_path, "steps")) == 2


def test_archive_every_exits_0_on_sigterm(redis_url: str, experiment: str, tmp_path: Path) -> None:
    """`fulmen archive --every 1h` logs its first pass, and on SIGTERM makes a last one and exits 0."""
    env = {**os.environ, "REDIS_URL": redis_url, "FULMEN_EXPERIMENT": experiment}
    proc = subprocess.Popen([sys.executable, "-m", "fulmen.cli.main", "archive", "--every", "1h", "--to",
                             str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "archived" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        lines += proc.stderr.readlines()
        print("".join(lines))
        assert sum("archived" in line for line in lines) == 2  # the first pass, and the last one
    finally:
        stop_procs([proc])


def test_durations() -> None:
    """--every takes seconds, minutes, hours or days, and refuses what is not one of at least 1 s."""
    assert [parse_duration(t) for t in ("45", "30s", "10m", "1.5h", "1d")] == [45, 30, 600, 5400, 86400]
    for bad in ("", "10 minutes", "0s", "-5m", "m"):
        with pytest.raises(Exception, match="not a duration"):
            parse_duration(bad)
