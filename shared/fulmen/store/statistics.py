"""One snapshot of an experiment's pipeline, read in two pipelined round trips.

Shared by `RedisStore.statistics` (async client), the Prometheus collector and `fulmen top` (sync
clients): commands are queued the same way on either kind of pipeline, only ``execute`` differs, so
the command list and the parsing live here once.

Round trip 1: SCARD per status, XLEN of the streams, XINFO GROUPS of the consumed streams, ZCARD,
HLEN, the latest resources, TIME. Round trip 2 (only for groups with a backlog): the oldest entry
each group has not been delivered yet, whose id carries its enqueue time — the group's lag in seconds
(Redis 6.2 has no ``lag`` field in XINFO GROUPS; 7.0+ adds it, and we report it as well).
"""

from __future__ import annotations

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
    groups: dict[tuple[str, str], GroupInfo]  # only the groups that exist
    heartbeat_watched: int
    workers: int
    latest_resources: ResourcesUpdate | None
    server_time: float
    extra: list[Any] = field(default_factory=list)  # replies to commands the caller queued after ours

    @property
    def queue_depth(self) -> int:
        return self.rollouts["queuing"] + self.rollouts["requeuing"]

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
    for s in RolloutStatus:
        pipe.scard(keys.status(s))
    for name in STREAMS:
        pipe.xlen(getattr(keys, name))
    streams = list(dict.fromkeys(stream for stream, _ in GROUPS))
    for stream in streams:
        pipe.xinfo_groups(getattr(keys, stream))
    pipe.zcard(keys.watch_heartbeat)
    pipe.hlen(keys.workers)
    pipe.xrevrange(keys.resources_log, count=1)
    pipe.execute_command("TIME")  # cluster pipelines refuse .time(); this goes to any node
    return len(RolloutStatus) + len(STREAMS) + len(streams) + 4


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse_first(replies: list[Any]) -> Snapshot:
    it = iter(replies)
    rollouts = {s.value: int(next(it)) for s in RolloutStatus}
    lengths = {name: int(next(it)) for name in STREAMS}
    infos: dict[str, list[dict[Any, Any]]] = {}
    for stream in dict.fromkeys(stream for stream, _ in GROUPS):
        reply = next(it)
        infos[stream] = [] if isinstance(reply, Exception) else reply  # no such stream yet: no groups
    watched, workers, last, (seconds, micros) = next(it), next(it), next(it), next(it)
    groups = {}
    for stream, group in GROUPS:
        for info in infos[stream]:
            if _text(info.get("name")) != group:
                continue
            lag = info.get("lag")
            groups[(stream, group)] = GroupInfo(
                stream, group, int(info.get("consumers", 0)), int(info.get("pending", 0)),
                _text(info.get("last-delivered-id", "0-0")), None if lag is None else int(lag),
            )
    latest = None
    if last:
        try:
            latest = ResourcesUpdate.from_wire(last[0][1][b"m"])
        except (RecordError, KeyError):
            latest = None  # a bad record must not take the whole snapshot down
    return Snapshot(rollouts, lengths, groups, int(watched), int(workers), latest, seconds + micros / 1e6)


def _queue_lag(pipe: Any, keys: k.Keys, snap: Snapshot) -> list[tuple[str, str]]:
    """Queue round trip 2: each group's oldest undelivered entry. Returns the groups asked about."""
    asked = []
    for (stream, group), info in snap.groups.items():
        if snap.stream_lengths.get(stream, 0) and info.lag_entries != 0:
            pipe.xrange(getattr(keys, stream), min=f"({info.last_delivered_id}", count=1)
            asked.append((stream, group))
    return asked


def _with_lag(snap: Snapshot, asked: list[tuple[str, str]], replies: list[Any]) -> Snapshot:
    groups = dict(snap.groups)
    for key, reply in zip(asked, replies, strict=True):
        if reply and not isinstance(reply, Exception):
            enqueued_ms = int(_text(reply[0][0]).split("-")[0])
            age = max(0.0, snap.server_time - enqueued_ms / 1000)
            info = groups[key]
            groups[key] = GroupInfo(
                info.stream, info.group, info.consumers, info.pending, info.last_delivered_id,
                info.lag_entries, age,
            )
    return Snapshot(
        snap.rollouts, snap.stream_lengths, groups, snap.heartbeat_watched, snap.workers,
        snap.latest_resources, snap.server_time, snap.extra,
    )


def read_snapshot(client: redis.Redis, keys: k.Keys) -> Snapshot:
    """The snapshot with a sync client (the metrics thread, `fulmen top`)."""
    pipe = client.pipeline(transaction=False)
    _queue_first(pipe, keys)
    snap = _parse_first(pipe.execute(raise_on_error=False))
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
    snap = _parse_first(replies[:n])
    snap.extra.extend(replies[n:])
    pipe = client.pipeline(transaction=False)
    asked = _queue_lag(pipe, keys, snap)
    return _with_lag(snap, asked, await pipe.execute(raise_on_error=False) if asked else [])
