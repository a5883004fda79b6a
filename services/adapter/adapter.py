"""The adapter's loop: finished rollouts in, samples out, once per rollout.

Each batch is read from the finished stream, adapted by `fulmen_adapter.triplets`, and written,
marked and acknowledged in one Lua step; a redelivery is a no-op. Why: docs/design/adapter.md.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fulmen import keys as k
from fulmen.codec import pack, unpack
from fulmen.errors import RecordError, RedisUnavailable
from fulmen.records import Rollout, RolloutFinished, RolloutForSamples, RolloutStatus, SampleSkip
from fulmen.records.status import TERMINAL_ROLLOUT
from fulmen.serving.rewards import version_reward_stats
from fulmen.store import RedisStore
from fulmen.tasks import task_id
from fulmen.telemetry import semconv
from fulmen_adapter.groups import GroupStep
from fulmen_adapter.judge import GroupJudge, JudgeConfig
from fulmen_adapter.triplets import Adapted, AdapterConfig, AttemptInfo, Skip, wire_samples

log = logging.getLogger(__name__)

DEFAULT_BATCH = 128  # finished rollouts per lane's read and write (see `Adapter.run` on lanes)
DEFAULT_LANES = 8
DEFAULT_RECLAIM_IDLE_S = 30.0  # an entry pending this long belongs to an adapter that died
READ_BLOCK_S = 1.0  # a lane's blocking read: how soon it sees ``stop``
REPORT_INTERVAL_S = 10.0  # between two progress log lines
# A reclaim costs a round trip, and nothing goes idle faster than the idle period: look a few times
# per period, but at most once a second.
RECLAIMS_PER_IDLE_PERIOD = 3
MIN_RECLAIM_INTERVAL_S = 1.0
# Errors of the connection, not of an entry: never a reason to dead-letter one (the loop's caller
# rides out the outage).
TRANSIENT_ERRORS = (RedisConnectionError, RedisTimeoutError, RedisUnavailable)
_new_tuple = tuple.__new__
GC_THRESHOLD_0 = 50_000  # allocations between young-generation collections (`tune_for_batches`)
# glibc's mallopt parameters (malloc.h) and what `keep_freed_memory` sets them to: blocks up to 32 MiB
# (glibc's largest) from the heap, whose free top is kept up to 128 MiB (a few batches' worth).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 128 << 20


def group_key(rollout: Rollout | RolloutForSamples) -> str:
    """The task a rollout belongs to: the algorithm's ``group_key`` metadata, else a hash of the input."""
    key = rollout.metadata.get("group_key")
    if isinstance(key, str) and key:
        return key
    task = rollout.input if isinstance(rollout, Rollout) else _input(rollout)
    return task_id(task)


def _input(rollout: RolloutForSamples) -> Any:
    try:
        return unpack(rollout.input_blob) if rollout.input_blob else None
    except RecordError:
        return rollout.input_blob.hex()  # an unreadable input still groups consistently


@dataclass
class Counters:
    rollouts: int = 0
    samples: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    # judge/... (the group step's outcomes) and calls/... (LLM calls left out for their purpose)
    more: dict[str, int] = field(default_factory=dict)


class Adapter:
    def __init__(
        self,
        store: RedisStore,
        config: AdapterConfig | None = None,
        *,
        consumer: str | None = None,
        batch: int = DEFAULT_BATCH,
        reclaim_idle_s: float = DEFAULT_RECLAIM_IDLE_S,
        judge: JudgeConfig | None = None,
    ) -> None:
        """``judge``: rescore each train group once all its rollouts have ended (`fulmen_adapter.groups`);
        its rollouts' entries are then held unacknowledged for up to its wait and judging time, which
        ``reclaim_idle_s`` must exceed (`held_reclaim_idle_s`)."""
        self.store = store
        self.config = config or AdapterConfig()
        self.consumer = consumer or f"adapter-{socket.gethostname()}-{os.getpid()}"
        self.batch = batch
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self.counters = Counters()
        self._next_reclaim = 0.0
        self.groups = None if judge is None else GroupStep(
            GroupJudge(judge), self._adapt, self._append, self._dead_letter, group_key, store.spans.add_spans
        )

    async def run(self, stop: asyncio.Event, *, until_idle: bool = False, lanes: int = DEFAULT_LANES) -> None:
        """Adapt finished rollouts until ``stop`` is set (or, with ``until_idle``, until none are left).

        ``lanes`` batches are in flight at once, so one batch's round trips to Redis overlap with the
        others' Python work (each lane reads its own entries from the consumer group). Many small
        batches rather than a few large ones: Redis runs one command at a time, so a large batch's
        read or write holds it while the other lanes' commands queue behind it (bench/RESULTS.md,
        "Adapter throughput", has the measurements behind the defaults)."""
        await self.store.finished.ensure_finished_group(k.ADAPTER_GROUP)
        log.info("adapter %s on experiment %s", self.consumer, self.store.experiment)
        if self.groups is None:
            await asyncio.gather(*(self._lane(stop, until_idle, report=i == 0) for i in range(lanes)))
            return
        watch = asyncio.create_task(self.groups.watch(stop), name="judge-groups")
        try:
            await asyncio.gather(*(self._lane(stop, until_idle, report=i == 0) for i in range(lanes)))
            if until_idle:  # nothing more will come: the groups still gathering are written as they are
                await self.groups.drain()
        finally:
            watch.cancel()
            await self.groups.close()

    async def _lane(self, stop: asyncio.Event, until_idle: bool, report: bool) -> None:
        last_report, reported = time.monotonic(), 0
        while not stop.is_set():
            finished = await self._reclaim() or await self.store.finished.read_finished(
                k.ADAPTER_GROUP, self.consumer, self.batch, None if until_idle else READ_BLOCK_S
            )
            if finished:
                await self.process(finished)
            elif until_idle:
                return
            if report and time.monotonic() - last_report > REPORT_INTERVAL_S and self.counters.rollouts > reported:
                log.info(
                    "adapted %d rollouts: %d samples, skipped %s",
                    self.counters.rollouts, self.counters.samples, self.counters.skipped or "none",
                )
                last_report, reported = time.monotonic(), self.counters.rollouts

    async def _reclaim(self) -> list[RolloutFinished]:
        """Entries another adapter read but never acknowledged (it died), once they are idle."""
        if time.monotonic() < self._next_reclaim:
            return []
        interval_s = max(MIN_RECLAIM_INTERVAL_S, self.reclaim_idle_ms / 1000 / RECLAIMS_PER_IDLE_PERIOD)
        self._next_reclaim = time.monotonic() + interval_s
        return await self.store.finished.reclaim_finished(k.ADAPTER_GROUP, self.consumer, self.reclaim_idle_ms, self.batch)

    async def process(self, finished: Sequence[RolloutFinished]) -> None:
        """Adapt one batch, then acknowledge it (only once every sample is stored). If the batch fails
        for anything but the connection, its entries go one by one, and an entry that fails alone is
        dead-lettered with the reason: it would fail again after every restart."""
        try:
            await self._process(finished)
        except TRANSIENT_ERRORS:
            raise
        except Exception as e:
            if len(finished) > 1:
                for entry in finished:
                    await self.process([entry])
                return
            reason = f"could not adapt rollout {finished[0].rollout_id}: {type(e).__name__}: {e}"
            log.exception("%s", reason)
            await self.store.finished.dead_letter_finished(k.ADAPTER_GROUP, finished[0].entry_id, reason)

    async def _process(self, finished: Sequence[RolloutFinished]) -> None:
        rollouts = await self.store.samples.read_for_samples(list(dict.fromkeys(f.rollout_id for f in finished)))
        known = {r.rollout_id: r for r in rollouts if r is not None}
        # An entry for a rollout the store does not know: nothing to adapt, set aside with the reason.
        unknown = [f for f in finished if f.rollout_id not in known]
        if unknown:
            await self.store.finished.dead_letter_unknown(k.ADAPTER_GROUP, unknown)
        # Only a terminal rollout has all its spans: an entry for one still running was not written by
        # the store (which appends it as the rollout ends) and must not mark it sampled with a skip.
        early = {rid: r.status for rid, r in known.items() if r.status not in TERMINAL_ROLLOUT}
        for entry in finished:
            if entry.rollout_id in early:
                await self.store.finished.dead_letter_finished(
                    k.ADAPTER_GROUP, entry.entry_id,
                    f"rollout {entry.rollout_id} is {early[entry.rollout_id]}, not terminal: nothing to adapt",
                )
        ready = {rid: r for rid, r in known.items() if rid not in early}
        entries = [f for f in finished if f.rollout_id in ready]
        if self.groups is not None:  # train groups wait for their judge: held, not acknowledged
            entries = self.groups.take(ready, entries)
        await self._append([self._adapt(r) for r in ready.values()], [f.entry_id for f in entries])

    def _adapt(self, rollout: RolloutForSamples) -> Adapted:
        return adapt_rollout(rollout, self.config, self.store.max_record_bytes)

    async def _dead_letter(self, entry_id: str, reason: str) -> None:
        await self.store.finished.dead_letter_finished(k.ADAPTER_GROUP, entry_id, reason)

    async def _append(self, results: Sequence[Adapted], entry_ids: list[str]) -> None:
        """Write the batch's samples and acknowledge their finished entries, in one atomic step."""
        appended = await self.store.samples.append_samples(
            [(r.rollout_id, r.records, r.stats, r.model_version) for r in results], ack_group=k.ADAPTER_GROUP, ack_entry_ids=entry_ids
        )
        for result, n in zip(results, appended, strict=True):
            if n <= 0:
                continue  # sampled before (a redelivery) or deleted meanwhile: nothing was written
            self.counters.rollouts += 1
            for name, value in result.stats.items():
                if "/" in name:  # judge/..., calls/...
                    self.counters.more[name] = self.counters.more.get(name, 0) + value
            if "skipped" in result.stats:
                code = next(name for name in result.stats if name.startswith("skip:"))[5:]
                self.counters.skipped[code] = self.counters.skipped.get(code, 0) + 1
            else:
                self.counters.samples += n


def adapt_rollout(rollout: RolloutForSamples, config: AdapterConfig, max_bytes: int) -> Adapted:
    """One finished rollout's sample records (or its skip record), as the adapter appends them:
    pure, so `fulmen replay` turns archived or live spans into the same bytes."""
    result = _samples(rollout, config, max_bytes)
    if not isinstance(rollout.spans, RecordError):
        result.model_version = _served_version(rollout.spans, rollout.attempt_id)
    return result


def _samples(rollout: RolloutForSamples, config: AdapterConfig, max_bytes: int) -> Adapted:
    spans = rollout.spans
    info = _new_tuple(AttemptInfo, (  # without the named tuple's Python-level __new__ (one per rollout)
        rollout.rollout_id,
        rollout.attempt_id or "",
        group_key(rollout),
        rollout.mode,
        _int_or_none(rollout.metadata.get("group_size")),
        rollout.reward,
    ))
    counted: dict[str, int] = {}  # the calls left out for their purpose (a judge's)
    try:
        if rollout.status is not RolloutStatus.SUCCEEDED:
            raise Skip(rollout.status.value, f"rollout {rollout.status.value}")
        if isinstance(spans, RecordError):
            raise Skip("malformed_span", f"malformed span record: {spans}")
        samples = wire_samples(spans, info, config, counted)
        records = [pack(sample, max_bytes) for sample in samples]  # `pack_sample`'s bytes
        stats = {"rollouts": 1, "samples": len(records), **counted}
        version = None  # of the last sample that names one
        for sample in reversed(samples):
            if sample["model_version"]:
                version = sample["model_version"]
                break
        reward = samples[-1]["final_reward"]  # every sample has the attempt's
        if version is not None and isinstance(reward, (int, float)) and math.isfinite(reward):
            stats.update(version_reward_stats(info.mode or "train", str(version), float(reward)))
        return Adapted(rollout.rollout_id, records, stats)
    except Skip as e:
        code, reason = e.code, str(e)
    except RecordError as e:  # a sample over the size limit: say so, keep going
        code, reason = "too_large", str(e)
    skip = SampleSkip(
        rollout.rollout_id, rollout.attempt_id, info.group_key, rollout.status.value, reason,
        info.mode, info.group_size,
    )
    return Adapted(rollout.rollout_id, [skip.to_wire()], {"rollouts": 1, "skipped": 1, f"skip:{code}": 1, **counted})


def held_reclaim_idle_s(judge: JudgeConfig | None) -> float:
    """How long an entry may stay pending before another adapter takes it over: with a judge, longer
    than a group is held and judged, or a live adapter's held entries would be taken as a dead one's."""
    if judge is None:
        return DEFAULT_RECLAIM_IDLE_S
    return judge.wait_s + judge.timeout_s + DEFAULT_RECLAIM_IDLE_S


def tune_for_batches() -> None:
    """Process-wide: the cycle collector and the C allocator set for batches (call once, from the
    entry point, last).

    A batch allocates tens of thousands of short-lived containers (decoded span records, reply lists):
    with the default threshold (700) the collector runs many times per batch, mostly re-scanning the
    same live batch, a visible share of the adapter's CPU (bench/RESULTS.md). Objects from start-up
    are frozen out of its way; cycles are still collected, only in larger steps. A batch's buffers
    (its spans' reply, its samples' write: about a megabyte each) are freed and made again a moment
    later: glibc gives such memory back to the kernel and then faults it in again page by page,
    so it is told to keep it (`keep_freed_memory`)."""
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD_0, 20, 20)
    keep_freed_memory()


def keep_freed_memory() -> bool:
    """glibc's malloc set to serve blocks up to `MMAP_THRESHOLD` from its heap and to give the heap's
    free top back only past `TRIM_THRESHOLD`; False where the C library has no ``mallopt`` (not glibc)
    or refuses."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _served_version(spans: Sequence[Any], attempt_id: str | None) -> str:
    """The model version of the latest attempt's last LLM call ('' without one)."""
    for span in reversed(spans):
        if span.attempt_id == attempt_id and span.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL:
            version = span.attributes.get(semconv.MODEL_VERSION)
            return version if isinstance(version, str) else ""
    return ""


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
