"""One snapshot of an experiment's pipeline, read in two pipelined round trips.

Shared by `RedisStore.statistics`, the Prometheus collector and `fulmen top`. What each round trip
reads: docs/design/store.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from fulmen import keys as k
from fulmen.errors import RecordError
from fulmen.records import ResourcesUpdate
from fulmen.records.status import RolloutStatus

# (stream attribute of Keys, consumer group) pairs worth watching: who consumes what
GROUPS: tuple[tuple[str, str], ...] = (
    ("queue", k.RUNNERS_GROUP),
    ("finished", k.ADAPTER_GROUP),
    ("finished", k.ALGORITHM_GROUP),
    ("samples", k.TRAINERS_GROUP),
)
STREAMS = ("queue", "finished", "samples", "dead_letters")
SHARDED = ("queue", "finished")  # the streams with one key per shard


def _stream_keys(keys: k.Keys, name: str) -> list[str]:
    """A stream's key in each shard (one key for an experiment-wide stream); the queue's, every
    priority lane's in each shard (`ShardKeys.queues`)."""
    if name == "queue":
        return [key for shard in keys.shards for key in shard.queues]
    if name in SHARDED:
        return [getattr(shard, name) for shard in keys.shards]
    return [getattr(keys, name)]


@dataclass(frozen=True, slots=True)
class GroupInfo:
    stream: str  # the Keys attribute: queue, finished, samples
    group: str
    consumers: int
    pending: int  # delivered, not acknowledged
    last_delivered_id: str
    lag_entries: int | None  # Redis 7+: entries not delivered yet (None when the server does not say)
    lag_s: float = 0.0  # age of the oldest entry not delivered yet (0: nothing waiting)


@dataclass(frozen=True, slots=True)
class Snapshot:
    rollouts: dict[str, int]  # per status
    stream_lengths: dict[str, int]  # per STREAMS name
    lane_lengths: dict[str, int]  # entries in each priority lane's queue streams, summed over shards
    groups: dict[tuple[str, str], GroupInfo]  # only the groups that exist (summed over shards)
    heartbeat_watched: int
    workers: int
    latest_resources: ResourcesUpdate | None
    server_time: float
    extra: list[Any] = field(default_factory=list)  # replies to commands the caller queued after ours
    # (stream key, group) -> last delivered id, per shard: where round trip 2 looks for the lag
    delivered: dict[tuple[str, str, str], str] = field(default_factory=dict)

    @property
    def queue_depth(self) -> int:
        return self.rollouts["queuing"] + self.rollouts["requeuing"]

    @property
    def queue_depth_by_lane(self) -> dict[str, int]:
        """Rollouts waiting in each priority lane. A claimed entry is deleted from the urgent and low
        lanes, so their length is what waits there; the normal lane keeps its entries until retention
        trims them, so what waits there is the rest of the queue depth."""
        waiting = {lane: self.lane_lengths.get(lane, 0) for lane in k.LANES if lane != k.DEFAULT_LANE}
        return {lane: waiting[lane] if lane in waiting else max(0, self.queue_depth - sum(waiting.values()))
                for lane in k.LANES}

    @property
    def active_attempts(self) -> int:
        return self.rollouts["preparing"] + self.rollouts["running"]

    @property
    def model_version(self) -> str | None:
        """The policy's model version in the latest resources (None if they name no LLM)."""
        if self.latest_resources is None:
            return None
        llm = self.latest_resources.resources.get("llm")
        return llm.get("model_version") if isinstance(llm, dict) else None


def _queue_first(pipe: Any, keys: k.Keys) -> int:
    """Queue round trip 1 on ``pipe``; returns how many replies it adds."""
    n = 0
    for s in RolloutStatus:
        for shard in keys.shards:
            pipe.scard(shard.status(s))
            n += 1
    for name in STREAMS:
        for key in _stream_keys(keys, name):
            pipe.xlen(key)
            n += 1
    for stream in dict.fromkeys(stream for stream, _ in GROUPS):
        for key in _stream_keys(keys, stream):
            pipe.xinfo_groups(key)
            n += 1
    for shard in keys.shards:
        pipe.zcard(shard.watch_heartbeat)
        n += 1
    pipe.hlen(keys.workers)
    pipe.xrevrange(keys.resources_log, count=1)
    pipe.execute_command("TIME")  # cluster pipelines refuse .time(); this goes to any node
    return n + 3


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse_first(replies: list[Any], keys: k.Keys) -> Snapshot:
    """The snapshot from round trip 1's replies (`_queue_first`, in its order)."""
    it = iter(replies)
    shards = len(keys.shards)
    rollouts = {s.value: sum(int(next(it)) for _ in range(shards)) for s in RolloutStatus}
    lengths, lane_lengths = _stream_lengths(it, keys)
    infos: dict[str, list[tuple[str, list[dict[Any, Any]]]]] = {}
    for stream in dict.fromkeys(stream for stream, _ in GROUPS):
        infos[stream] = []
        for key in _stream_keys(keys, stream):
            reply = next(it)
            infos[stream].append((key, [] if isinstance(reply, Exception) else reply))  # no stream: no groups
    watched = sum(int(next(it)) for _ in range(shards))
    workers, last, (seconds, micros) = next(it), next(it), next(it)
    groups, delivered = _group_infos(infos)
    return Snapshot(rollouts, lengths, lane_lengths, groups, watched, int(workers), _latest_resources(last),
                    seconds + micros / 1e6, delivered=delivered)


def _stream_lengths(it: Iterator[Any], keys: k.Keys) -> tuple[dict[str, int], dict[str, int]]:
    """Each of STREAMS' length (summed over its shards) and each priority lane's, from the XLEN replies."""
    lengths: dict[str, int] = {}
    lane_lengths = dict.fromkeys(k.LANES, 0)
    for name in STREAMS:
        replies = [int(next(it)) for _ in _stream_keys(keys, name)]
        lengths[name] = sum(replies)
        if name == "queue":  # shard by shard, each shard's lanes in `k.LANES` order
            for i, n in enumerate(replies):
                lane_lengths[k.LANES[i % len(k.LANES)]] += n
    return lengths, lane_lengths


def _group_infos(infos: dict[str, list[tuple[str, list[dict[Any, Any]]]]],
                 ) -> tuple[dict[tuple[str, str], GroupInfo], dict[tuple[str, str, str], str]]:
    """Each group of GROUPS summed over the shards of its stream (from XINFO GROUPS per stream key), and
    the id it last delivered in each shard."""
    groups: dict[tuple[str, str], GroupInfo] = {}
    delivered: dict[tuple[str, str, str], str] = {}
    for stream, group in GROUPS:
        for key, shard_infos in infos[stream]:
            for info in shard_infos:
                if _text(info.get("name")) != group:
                    continue
                lag = info.get("lag")
                last_id = _text(info.get("last-delivered-id", "0-0"))
                delivered[(stream, group, key)] = last_id
                before = groups.get((stream, group))
                info_lag = None if lag is None else int(lag)
                if before is not None:
                    info_lag = None if before.lag_entries is None or info_lag is None else before.lag_entries + info_lag
                groups[(stream, group)] = GroupInfo(
                    stream, group, max(int(info.get("consumers", 0)), before.consumers if before else 0),
                    int(info.get("pending", 0)) + (before.pending if before else 0),
                    before.last_delivered_id if before else last_id, info_lag,
                )
    return groups, delivered


def _latest_resources(last: Any) -> ResourcesUpdate | None:
    """The newest resources update from its XREVRANGE reply; None if there is none or it is unreadable."""
    if not last:
        return None
    try:
        return ResourcesUpdate.from_wire(last[0][1][b"m"])
    except (RecordError, KeyError):
        return None  # a bad record must not take the whole snapshot down


def _queue_lag(pipe: Any, keys: k.Keys, snap: Snapshot) -> list[tuple[str, str]]:
    """Queue round trip 2: each group's oldest undelivered entry, in each shard. Returns the groups
    asked about (once per shard)."""
    asked = []
    for (stream, group, key), last_id in snap.delivered.items():
        info = snap.groups[(stream, group)]
        if snap.stream_lengths.get(stream, 0) and info.lag_entries != 0:
            pipe.xrange(key, min=f"({last_id}", count=1)
            asked.append((stream, group))
    return asked


def _with_lag(snap: Snapshot, asked: list[tuple[str, str]], replies: list[Any]) -> Snapshot:
    groups = dict(snap.groups)
    for key, reply in zip(asked, replies, strict=True):
        if reply and not isinstance(reply, Exception):
            enqueued_ms = int(_text(reply[0][0]).split("-")[0])
            age = max(0.0, snap.server_time - enqueued_ms / 1000)
            info = groups[key]
            age = max(age, info.lag_s)  # the oldest of its shards' backlogs
            groups[key] = GroupInfo(
                info.stream, info.group, info.consumers, info.pending, info.last_delivered_id,
                info.lag_entries, age,
            )
    return Snapshot(
        snap.rollouts, snap.stream_lengths, snap.lane_lengths, groups, snap.heartbeat_watched, snap.workers,
        snap.latest_resources, snap.server_time, snap.extra, snap.delivered,
    )


def read_snapshot(client: redis.Redis, keys: k.Keys) -> Snapshot:
    """The snapshot with a sync client (the metrics thread, `fulmen top`)."""
    pipe = client.pipeline(transaction=False)
    _queue_first(pipe, keys)
    snap = _parse_first(pipe.execute(raise_on_error=False), keys)
    pipe = client.pipeline(transaction=False)
    asked = _queue_lag(pipe, keys, snap)
    return _with_lag(snap, asked, pipe.execute(raise_on_error=False) if asked else [])


async def aread_snapshot(client: aioredis.Redis, keys: k.Keys, extra: Any = None) -> Snapshot:
    """The snapshot with an async client. ``extra(pipe)`` may queue more commands in round trip 1;
    their replies come back in ``Snapshot.extra``."""
    pipe = client.pipeline(transaction=False)
    n = _queue_first(pipe, keys)
    if extra is not None:
        extra(pipe)
    replies = await pipe.execute(raise_on_error=False)
    snap = _parse_first(replies[:n], keys)
    snap.extra.extend(replies[n:])
    pipe = client.pipeline(transaction=False)
    asked = _queue_lag(pipe, keys, snap)
    return _with_lag(snap, asked, await pipe.execute(raise_on_error=False) if asked else [])
