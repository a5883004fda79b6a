"""The watchdog: ends attempts that ran past their timeout or stopped heartbeating, and, given a
retention policy, trims the store by it every so often (`fulmen.retention.trim`).

Safe to run in any number of processes at once. Why: docs/design/store.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass

from redis.exceptions import RedisError

from fulmen import keys as k
from fulmen.errors import FulmenError
from fulmen.records.status import AttemptStatus
from fulmen.retention.trim import RetentionPolicy, trim
from fulmen.store.redis_store import RedisStore

log = logging.getLogger(__name__)

SWEEP_LIMIT = 1000  # overdue attempts of each kind ended per pass; the next pass takes the rest


async def sweep(store: RedisStore, limit: int = SWEEP_LIMIT) -> Counter[str]:
    """One pass over overdue attempts. Returns how many ended in each outcome (requeued, failed…)."""
    seconds, micros = await store.redis.time()
    now = seconds + micros / 1e6
    outcomes: Counter[str] = Counter()
    for key, kind in [
        pair
        for shard in store.keys.shards  # each shard's attempts are watched in its own sets
        for pair in ((shard.watch_deadline, AttemptStatus.TIMEOUT), (shard.watch_heartbeat, AttemptStatus.UNRESPONSIVE))
    ]:
        overdue = await store.redis.zrangebyscore(key, "-inf", now, start=0, num=limit)
        for raw in overdue:
            attempt_id = raw.decode()
            rollout_id = k.rollout_of_attempt(attempt_id)
            code = await store.rollouts.expire_attempt(rollout_id, attempt_id, kind)
            outcomes[code] += 1
            if code not in ("fresh", "already"):
                log.debug("attempt %s: %s -> rollout %s", attempt_id, kind.value, code)
    return outcomes


INTERVAL_S = 1.0  # between sweeps: an attempt is ended at most this long after its deadline
RETENTION_INTERVAL_S = 300.0  # between retention passes, unless the schedule says otherwise


@dataclass(frozen=True, slots=True)
class RetentionSchedule:
    """Trim by ``policy`` when the watchdog starts and every ``interval_s`` after."""

    policy: RetentionPolicy
    interval_s: float = RETENTION_INTERVAL_S


async def run_watchdog(
    store: RedisStore,
    interval_s: float = INTERVAL_S,
    stop: asyncio.Event | None = None,
    retention: RetentionSchedule | None = None,
) -> None:
    """Sweep every ``interval_s`` until ``stop`` is set; with ``retention``, trim by its schedule."""
    stop = stop or asyncio.Event()
    next_trim = time.monotonic()
    while not stop.is_set():
        started = time.monotonic()
        outcomes = await sweep(store)
        ended = sum(n for code, n in outcomes.items() if code != "fresh")
        if ended:  # one line per sweep, not per attempt: a dead worker may hold hundreds
            log.warning(
                "watchdog ended %d attempts in %.3fs: %s", ended, time.monotonic() - started, dict(outcomes)
            )
        if retention is not None and time.monotonic() >= next_trim:
            await _retain(store, retention.policy)
            next_trim = time.monotonic() + retention.interval_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


async def _retain(store: RedisStore, policy: RetentionPolicy) -> None:
    """One retention pass. A failed pass is logged and tried again at the next one: the sweep, which
    keeps rollouts moving, must not stop for it."""
    started = time.monotonic()
    try:
        report = await trim(store, policy)
    except (RedisError, FulmenError):
        log.exception("retention pass failed on experiment %s; trying again at the next one", store.experiment)
        return
    if report.total:
        log.info("retention pass took %.3fs", time.monotonic() - started)
