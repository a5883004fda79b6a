"""The reporter: it tails the experiment's trainer steps and validations streams, hands what is new to
every tracker's worker, and keeps its place and the tracker run's id in Redis (`Keys.trackers`).

Started again (the algorithm restarted), it resumes the same run where it stopped and reports no step
twice; the trainer restarting changes nothing for it (its steps continue in the stream). It runs in
the algorithm's process, off the training step (`reporting`). Why: docs/design/telemetry.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fulmen.errors import RecordError
from fulmen.records import TrainStep
from fulmen.store import RedisStore
from fulmen.telemetry.trackers.tracker import Entry, RunInfo, Tracker
from fulmen.telemetry.trackers.worker import QUEUE_SIZE, Retry, TrackerWorker, join_all

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often the streams are read when nothing was new
PAGE = 500  # entries per stream per read
DRAIN_S = 3.0  # at the end, what the trackers get to finish in (honcho kills 5 s after SIGTERM)
# The fields of the experiment's trackers hash.
RUN, STEPS, VALIDATIONS, STEP, LABEL = "run", "steps", "validations", "step", "label:"
VALIDATION_SKIPS = ("step", "time")  # a pass's numbers that are not its results


class Reporter:
    """Report one experiment's metrics to ``trackers``, each in its own `TrackerWorker`."""

    def __init__(self, store: RedisStore, trackers: Sequence[Tracker], *, name: str,
                 config: Mapping[str, Any] | None = None, queue_size: int = QUEUE_SIZE,
                 retry: Retry | None = None) -> None:
        self.store, self.trackers, self.name = store, list(trackers), name
        self.config = dict(config or {})
        self.queue_size, self.retry = queue_size, retry
        self.workers: list[TrackerWorker] = []
        self.run: RunInfo | None = None
        self._steps_id, self._validations_id = "0-0", "0-0"
        self._step = 0  # the last step reported: a step recorded again (a trainer restart) is not
        self._labels: set[str] = set()  # the passes reported: a pass recorded twice counts once

    async def start(self) -> RunInfo:
        """Read (or create) the run's id and the read positions, and start the trackers' threads."""
        redis, key = self.store.redis, self.store.keys.trackers
        await redis.hsetnx(key, RUN, f"{self.name}-{secrets.token_hex(4)}")
        state = {_text(k): _text(v) for k, v in (await redis.hgetall(key)).items()}
        self._steps_id = state.get(STEPS, "0-0")
        self._validations_id = state.get(VALIDATIONS, "0-0")
        self._step = int(state.get(STEP, 0))
        self._labels = {k[len(LABEL):] for k in state if k.startswith(LABEL)}
        self.run = RunInfo(state[RUN], self.name, self.config)
        self.workers = [TrackerWorker(t, self.run, queue_size=self.queue_size, retry=self.retry) for t in self.trackers]
        for worker in self.workers:
            worker.start()
        log.info("reporting to %s: run %s, from step %d", ", ".join(t.name for t in self.trackers),
                 self.run.run_id, self._step)
        return self.run

    async def poll(self) -> int:
        """Read what is new in both streams once, record the new position, then offer the entries to
        every tracker (recorded first: a crash loses entries rather than reporting one twice). The
        number of stream entries read (0: nothing new)."""
        keys = self.store.keys
        replies = _stream_replies(await self.store.redis.xread(
            {keys.trainer_steps: self._steps_id, keys.validations: self._validations_id}, count=PAGE))
        read = sum(len(entries) for _, entries in replies)
        if not read:
            return 0
        train: list[Entry] = []
        passes: list[Entry] = []
        labels: list[str] = []
        for stream, entries in replies:
            for entry_id, fields in entries:
                if stream == keys.trainer_steps:
                    self._steps_id = _text(entry_id)
                    train.extend(self._train_entry(fields))
                else:
                    self._validations_id = _text(entry_id)
                    passes.extend(self._validation_entry(fields, labels))
        counts = await self._rollouts_entry() if train else None
        await self._save(labels)
        for entry in (*train, *passes, *([counts] if counts else [])):
            for worker in self.workers:
                worker.offer(entry)
        return read

    async def follow(self, poll_s: float = POLL_S) -> None:
        """Poll until cancelled; a Redis error is logged and the next poll tries again."""
        while True:
            try:
                if await self.poll():
                    continue
            except Exception as e:  # reporting never ends the run: Redis may be restarting
                log.warning("trackers: reading the metrics failed (%s: %s); trying again", type(e).__name__, e)
            await asyncio.sleep(poll_s)

    async def close(self, drain_s: float = DRAIN_S) -> None:
        """Read the last entries (the final validation), let the trackers finish for up to
        ``drain_s`` in all, and say what each did not get."""
        with contextlib.suppress(Exception):  # the run is over: what Redis no longer answers is lost
            while await self.poll():
                pass
        left = await asyncio.to_thread(join_all, self.workers, drain_s)
        for worker in self.workers:
            waiting = worker.queue.qsize() if worker in left else 0
            if worker in left:
                log.warning("tracker %s did not finish within %.0f s (%d entries waiting): left behind",
                            worker.name, drain_s, waiting)
            if worker.dropped or waiting:
                log.warning("tracker %s: %d entries reported, %d dropped", worker.name, worker.reported,
                            worker.dropped + waiting)

    def _train_entry(self, fields: Mapping[bytes, bytes]) -> list[Entry]:
        try:
            summary = TrainStep.from_wire(fields.get(b"m"))
        except RecordError:
            return []  # one unreadable entry must not hide the rest
        if summary.step <= self._step:
            return []  # recorded again after a trainer restart: reported already
        self._step = summary.step
        metrics = dict(summary.metrics)
        for key, value in (("rollout/reward_mean", summary.reward_mean), ("loss/total", summary.loss),
                           ("perf/samples", summary.samples)):
            if value is not None:
                metrics.setdefault(key, float(value))
        return [Entry("train", summary.step, metrics, summary.time)]

    def _validation_entry(self, fields: Mapping[bytes, bytes], labels: list[str]) -> list[Entry]:
        try:
            result = json.loads(fields[b"m"])
        except (KeyError, ValueError):
            return []
        label = str(result.get("label")) if isinstance(result, dict) else None
        if label is None or label in self._labels:
            return []
        self._labels.add(label)
        labels.append(label)
        step = result.get("step")
        metrics = {f"val/{k}": float(v) for k, v in result.items()
                   if k not in VALIDATION_SKIPS and isinstance(v, int | float) and not isinstance(v, bool)}
        when = result.get("time")
        return [Entry("validation", int(step) if isinstance(step, int) else self._step, metrics,
                      float(when) if isinstance(when, int | float) else 0.0)]

    async def _rollouts_entry(self) -> Entry | None:
        """The rollouts per status now, at the last step reported."""
        try:
            stats = await self.store.statistics()
        except Exception as e:  # a missed count is no loss: the next step's poll counts again
            log.debug("trackers: no rollout counts (%s)", e)
            return None
        return Entry("rollouts", self._step, {f"rollouts/{s}": float(n) for s, n in stats["rollouts"].items()},
                     time.time())

    async def _save(self, labels: list[str]) -> None:
        mapping: dict[str, str | int] = {STEPS: self._steps_id, VALIDATIONS: self._validations_id, STEP: self._step}
        mapping.update({LABEL + label: 1 for label in labels})
        await self.store.redis.hset(self.store.keys.trackers, mapping=mapping)


@contextlib.asynccontextmanager
async def reporting(store: RedisStore, trackers: Sequence[Tracker], *, name: str,
                    config: Mapping[str, Any] | None = None) -> AsyncIterator[Reporter | None]:
    """Report to ``trackers`` while the block runs (nothing when there are none): the reporter follows
    the streams in a task of this loop, its trackers each in a thread; at the end it drains, bounded."""
    if not trackers:
        yield None
        return
    reporter = Reporter(store, trackers, name=name, config=config)
    await reporter.start()
    task = asyncio.create_task(reporter.follow(), name="trackers")
    try:
        yield reporter
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await reporter.close()


def _stream_replies(replies: Any) -> list[tuple[str, list[tuple[Any, Mapping[bytes, bytes]]]]]:
    """XREAD's reply as (stream, entries) pairs, whether the client speaks RESP2 (a list) or RESP3 (a dict)."""
    if isinstance(replies, dict):
        items = [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in replies.items()]
    else:
        items = [(k, v) for k, v in replies or []]
    return [(_text(k), list(v)) for k, v in items]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
