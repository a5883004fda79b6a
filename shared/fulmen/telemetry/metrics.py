"""Prometheus collectors: pipeline-wide gauges read from Redis at scrape time, per-process counters.

Aggregate the pipeline gauges across services with ``max``, not ``sum``. Why: docs/design/telemetry.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis.exceptions import RedisError

from fulmen import keys as k
from fulmen.store.statistics import read_snapshot
from fulmen.versions.model_version import ModelVersion

log = logging.getLogger(__name__)


class PipelineCollector:
    """Pipeline-wide gauges of one experiment, read from Redis on each scrape."""

    def __init__(self, client: redis.Redis, keys: k.Keys) -> None:
        self.client = client
        self.keys = keys

    def describe(self) -> list[Metric]:
        return []  # registering must not touch Redis; the names are checked on each collect

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("fulmen_redis_up", "1 if Redis answered this scrape's reads.")
        try:
            snap = read_snapshot(self.client, self.keys)
        except (RedisError, OSError) as e:
            log.debug("pipeline metrics unavailable: %s", type(e).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        per_status = GaugeMetricFamily("fulmen_rollouts", "Rollouts per status.", labels=["status"])
        for status, n in snap.rollouts.items():
            per_status.add_metric([status], n)
        yield per_status
        yield GaugeMetricFamily("fulmen_queue_depth", "Rollouts waiting for a runner.", value=snap.queue_depth)
        by_lane = GaugeMetricFamily("fulmen_queue_depth_by_lane", "Rollouts waiting, per priority lane.",
                                    labels=["lane"])
        for lane, n in snap.queue_depth_by_lane.items():
            by_lane.add_metric([lane], n)
        yield by_lane
        yield GaugeMetricFamily(
            "fulmen_active_attempts", "Attempts preparing or running.", value=snap.active_attempts
        )
        yield GaugeMetricFamily(
            "fulmen_dead_letters", "Messages set aside as poison.", value=snap.stream_lengths["dead_letters"]
        )
        lengths = GaugeMetricFamily("fulmen_stream_length", "Entries in a stream (XLEN).", labels=["stream"])
        for name, n in snap.stream_lengths.items():
            lengths.add_metric([name], n)
        yield lengths
        labels = ["stream", "group"]
        pending = GaugeMetricFamily("fulmen_pending_entries", "Delivered, not acknowledged.", labels=labels)
        consumers = GaugeMetricFamily("fulmen_group_consumers", "Consumers known to a group.", labels=labels)
        lag_s = GaugeMetricFamily(
            "fulmen_consumer_lag_seconds", "Age of the oldest entry a group has not read yet.", labels=labels
        )
        lag_n = GaugeMetricFamily(
            "fulmen_consumer_lag_entries", "Entries a group has not read yet (Redis 7+).", labels=labels
        )
        for (stream, group), info in sorted(snap.groups.items()):
            pending.add_metric([stream, group], info.pending)
            consumers.add_metric([stream, group], info.consumers)
            lag_s.add_metric([stream, group], info.lag_s)
            if info.lag_entries is not None:
                lag_n.add_metric([stream, group], info.lag_entries)
        yield from (pending, consumers, lag_s, lag_n)
        yield GaugeMetricFamily("fulmen_workers", "Runner processes registered.", value=snap.workers)
        yield GaugeMetricFamily(
            "fulmen_heartbeat_watched", "Attempts the watchdog watches.", value=snap.heartbeat_watched
        )
        version = GaugeMetricFamily(
            "fulmen_model_version", "Number of the model version in the latest resources (v3 -> 3)."
        )
        if snap.model_version is not None:
            version.add_metric([], ModelVersion.parse(snap.model_version).number)
        yield version


@dataclass(frozen=True, slots=True)
class CounterValue:
    name: str  # without the _total suffix, e.g. fulmen_runner_claims
    help: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


class CountersCollector:
    """Counters of one process, read from its service objects at scrape time."""

    def __init__(self, read: Callable[[], Iterable[CounterValue]]) -> None:
        self.read = read

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily] = {}
        for c in self.read():
            family = families.get(c.name)
            if family is None:
                family = families[c.name] = CounterMetricFamily(c.name, c.help, labels=sorted(c.labels))
            family.add_metric([c.labels[name] for name in sorted(c.labels)], c.value)
        yield from families.values()
