"""The reporter with trackers that hang, fail or record: the intake and the trainer's step log go on,
errors are logged once by tracker name, what a tracker cannot take is dropped after its bound, and a
restart resumes the run without reporting a step twice."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest
from tracker_runs import trainer_steps, validation

from fulmen.store import RedisStore
from fulmen.telemetry.trackers import Entry, Reporter, RunInfo, Tracker
from fulmen.telemetry.trackers.reporter import STEP
from fulmen.telemetry.trackers.worker import Retry
from fulmen_trainer.metrics import StepMetrics

NO_WAIT = Retry(attempts=2, first_s=0.0, max_s=0.0)


class Recording(Tracker):
    name, package, extra = "recording", "json", "none"

    def __init__(self, folder: Path = Path()) -> None:
        super().__init__(folder)
        self.runs: list[RunInfo] = []
        self.entries: list[Entry] = []
        self.closed = threading.Event()

    def open(self, run: RunInfo) -> None:
        self.runs.append(run)

    def log(self, entry: Entry) -> None:
        self.entries.append(entry)

    def close(self) -> None:
        self.closed.set()

    def steps(self) -> list[int]:
        return [e.step for e in self.entries if e.kind == "train"]


class Hanging(Recording):
    """log() blocks until the test lets it go: a tracker whose server stopped answering."""

    name = "hanging"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.inside = threading.Event()

    def log(self, entry: Entry) -> None:
        self.inside.set()
        self.release.wait()


class Failing(Recording):
    name = "failing"

    def log(self, entry: Entry) -> None:
        raise ConnectionError("tracker server down")


async def test_a_hanging_tracker_blocks_neither_the_steps_nor_the_other_trackers(real_store: RedisStore) -> None:
    """With one tracker stuck inside log(), the trainer logs every step, the reporter reads them all
    and the healthy tracker gets them all; the stuck one's queue holds its bound, the rest is dropped.
    Each step waits for the healthy tracker to have it: on a busy machine slow to run that tracker's
    thread, steps 5 ms apart would fill its queue of 3 too, and it would drop steps for that."""
    hanging, healthy = Hanging(), Recording()
    reporter = Reporter(real_store, [hanging, healthy], name=real_store.experiment, queue_size=3, retry=NO_WAIT)
    await reporter.start()
    follow = asyncio.create_task(reporter.follow(poll_s=0.01))
    metrics = StepMetrics(0)
    metrics.log_steps_to(real_store)
    try:
        for step in range(1, 41):  # the training loop: a step, its record, the next step
            metrics.record(step, {"loss/total": 1.0 / step})
            await metrics.flush()
            deadline = asyncio.get_running_loop().time() + 30
            while step not in healthy.steps():  # the stuck tracker's worker does not hold it up
                assert asyncio.get_running_loop().time() < deadline, f"step {step} never reached the healthy tracker"
                await asyncio.sleep(0.005)
            if step == 1:
                await asyncio.to_thread(hanging.inside.wait, 30)  # from here on the tracker hangs
        while int(await real_store.redis.hget(real_store.keys.trackers, STEP) or 0) < 40:
            await asyncio.sleep(0.01)  # the reporter reads on while the tracker hangs
        assert hanging.inside.is_set() and not hanging.release.is_set()
        follow.cancel()
        await reporter.close(drain_s=0.2)  # returns though a thread is stuck in the tracker
    finally:
        follow.cancel()
        hanging.release.set()
    assert healthy.steps() == list(range(1, 41))
    stuck = reporter.workers[0]
    assert stuck.refused > 0 and stuck.reported <= 1 and stuck.queue.qsize() <= 3
    assert healthy.closed.is_set()


async def test_a_failing_tracker_is_retried_logged_once_and_its_entries_dropped(
    real_store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Each entry is tried as often as the retry says, then dropped; one log line names the tracker
    and the error; the other tracker gets every entry."""
    failing, healthy = Failing(), Recording()
    await trainer_steps(real_store, (1, 2, 3, 4, 5))
    reporter = Reporter(real_store, [failing, healthy], name=real_store.experiment, retry=NO_WAIT)
    await reporter.start()
    with caplog.at_level(logging.WARNING, logger="fulmen.telemetry.trackers"):
        while await reporter.poll():
            pass
        await reporter.close(drain_s=30)
    worker = reporter.workers[0]
    assert worker.reported == 0 and worker.failed == len(healthy.entries) and healthy.steps() == [1, 2, 3, 4, 5]
    errors = [r.getMessage() for r in caplog.records if "tracker server down" in r.getMessage()]
    assert len(errors) == 1 and "failing" in errors[0]
    assert any(f"{worker.failed} dropped" in r.getMessage() for r in caplog.records)


async def test_a_tracker_that_cannot_open_gets_nothing_and_stops_nothing(
    real_store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    """open() failing every try: the run goes on for the others, its entries are counted as dropped."""

    class Unreachable(Recording):
        name = "unreachable"

        def open(self, run: RunInfo) -> None:
            raise TimeoutError("no route to the tracking server")

    unreachable, healthy = Unreachable(), Recording()
    await trainer_steps(real_store, (1, 2))
    reporter = Reporter(real_store, [unreachable, healthy], name=real_store.experiment, retry=NO_WAIT)
    await reporter.start()
    with caplog.at_level(logging.WARNING, logger="fulmen.telemetry.trackers"):
        while await reporter.poll():
            pass
        await reporter.close(drain_s=30)
    assert healthy.steps() == [1, 2] and reporter.workers[0].failed == len(healthy.entries)
    assert sum("no route to the tracking server" in r.getMessage() for r in caplog.records) == 1
    assert any("unreachable" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


async def test_a_restart_resumes_the_run_and_reports_nothing_twice(real_store: RedisStore) -> None:
    """The second reporter opens the same run id and gets only what is new: a step the restarted
    trainer records again and a pass recorded twice are not reported again."""
    first = Recording()
    await validation(real_store, "v0", 0, 0.5)
    await trainer_steps(real_store, (1, 2, 3))
    one = Reporter(real_store, [first], name=real_store.experiment, config={"run": {"seed": 1}})
    await one.start()
    while await one.poll():
        pass
    await one.close()
    await trainer_steps(real_store, (3, 4))
    await validation(real_store, "v0", 0, 0.5)
    await validation(real_store, "v4", 4, 0.75)
    second = Recording()
    two = Reporter(real_store, [second], name=real_store.experiment, config={"run": {"seed": 1}})
    await two.start()
    while await two.poll():
        pass
    await two.close()
    assert first.runs[0].run_id == second.runs[0].run_id and first.runs[0].run_id.startswith(real_store.experiment)
    assert first.runs[0].config == {"run": {"seed": 1}}
    assert first.steps() == [1, 2, 3] and second.steps() == [4]
    assert [(e.step, e.metrics["val/accuracy"]) for e in first.entries if e.kind == "validation"] == [(0, 0.5)]
    assert [(e.step, e.metrics["val/accuracy"]) for e in second.entries if e.kind == "validation"] == [(4, 0.75)]
    train = [e for e in first.entries if e.kind == "train"]
    assert train[0].metrics["loss/total"] == 1.0 and train[0].metrics["comm/cosine"] == 0.99
    assert {e.kind for e in first.entries} == {"train", "validation", "rollouts"}


async def test_another_experiment_is_another_run(real_store: RedisStore) -> None:
    """A run id is the experiment's: a fresh experiment (or a flushed Redis) starts a new run."""
    a, b = Recording(), Recording()
    one = Reporter(real_store, [a], name=real_store.experiment)
    await one.start()
    await one.close()
    other = RedisStore(real_store.redis, f"{real_store.experiment}-b")
    two = Reporter(other, [b], name=other.experiment)
    await two.start()
    await two.close()
    assert a.runs[0].run_id != b.runs[0].run_id
