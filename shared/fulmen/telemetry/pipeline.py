"""The live pipeline as data: what `fulmen top` draws in a terminal and the dashboard shows in a browser.

`read_frame` / `aread_frame` read one `Frame`; `service_rows` and `rate` derive from it. Every read is a
fixed number of commands on known keys. More: docs/design/telemetry.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from fulmen import keys as k
from fulmen.errors import RecordError
from fulmen.records import ProxyEndpoint, ReplicaState, ServiceBeat, TrainStep, Worker
from fulmen.store.registry import PROXY_TTL_S
from fulmen.store.statistics import Snapshot, aread_snapshot, read_snapshot
from fulmen.telemetry.http import HEARTBEAT_S
from fulmen.telemetry.steps import TAIL_STEPS, decode_steps

LIVE_S = 3 * HEARTBEAT_S  # a heartbeat older than this: the process is gone (or stuck)
# The services a pipeline has, listed even when none is up (a missing one is what a person looks for).
EXPECTED_SERVICES = ("runner", "llm-proxy", "adapter", "trainer", "algorithm", "evaluator", "watchdog")


@dataclass
class Frame:
    """What one refresh read from Redis."""

    time: float  # the Redis server's clock, which every heartbeat is compared with
    snap: Snapshot
    services: list[ServiceBeat]
    workers: list[Worker]
    proxies: list[ProxyEndpoint]
    replicas: list[ReplicaState]
    adapter: dict[str, int]
    algorithm: dict[str, str]
    steps: list[TrainStep]  # the tail of the trainer's step log, oldest first

    @property
    def model_version(self) -> str:
        """The model version the views headline: the one the latest resources name; else (resources
        naming none, as a validation pass's do) what the live proxies and ready replicas serve, "base"
        before the first trained version, LoRA adapters included; "-" when nothing names or serves one."""
        if self.snap.model_version:
            return self.snap.model_version
        served = {p.model_version for p in live_proxies(self) if p.model_version}
        gone = replica_liveness(self)
        served |= {r.model_version for r in self.replicas if r.ready and not gone[r.url].gone}
        if served:
            return ", ".join(sorted(served, key=lambda v: (v != "base", len(v), v)))
        latest = self.snap.latest_resources
        return "base" if latest is not None and isinstance(latest.resources.get("llm"), dict) else "-"


@dataclass(frozen=True, slots=True)
class ServiceRow:
    """One service as the views list it: how many replicas are live, and a line of detail."""

    name: str
    live: int
    detail: str


def _records(raw: dict[bytes, bytes], decode: Callable[[bytes], Any]) -> list[Any]:
    out = []
    for value in raw.values():
        try:
            out.append(decode(value))
        except RecordError:
            continue  # one bad entry must not blank the view
    return out


def _queue_rest(pipe: Any, keys: k.Keys, steps: int) -> None:
    pipe.hgetall(keys.services)
    pipe.hgetall(keys.workers)
    pipe.hgetall(keys.proxies)
    pipe.hgetall(keys.replicas)
    pipe.hgetall(keys.adapter_stats)
    pipe.hgetall(keys.algorithm_state)
    pipe.xrevrange(keys.trainer_steps, count=steps)


def _frame(snap: Snapshot, replies: list[Any]) -> Frame:
    services, workers, proxies, replicas, adapter, algorithm, steps = replies
    return Frame(
        snap.server_time,
        snap,
        _records(services, ServiceBeat.from_wire),
        _records(workers, Worker.from_wire),
        _records(proxies, ProxyEndpoint.from_wire),
        _records(replicas, ReplicaState.from_wire),
        {key.decode(): int(v) for key, v in adapter.items() if v.lstrip(b"-").isdigit()},  # reward sums go below 0
        {key.decode(): v.decode(errors="replace") for key, v in algorithm.items()},
        decode_steps(list(reversed(steps))),
    )


def read_frame(client: redis.Redis, keys: k.Keys, steps: int = TAIL_STEPS) -> Frame:
    """One frame with a sync client (`fulmen top`)."""
    snap = read_snapshot(client, keys)
    pipe = client.pipeline(transaction=False)
    _queue_rest(pipe, keys, steps)
    return _frame(snap, pipe.execute())


async def aread_frame(client: aioredis.Redis, keys: k.Keys, steps: int = TAIL_STEPS) -> Frame:
    """One frame with an async client (the dashboard); the same commands as `read_frame`."""
    snap = await aread_snapshot(client, keys)
    pipe = client.pipeline(transaction=False)
    _queue_rest(pipe, keys, steps)
    return _frame(snap, await pipe.execute())


def live_workers(frame: Frame) -> list[Worker]:
    return [w for w in frame.workers
            if w.status != "stopped" and frame.time - (w.last_heartbeat_time or 0) <= LIVE_S]


def live_proxies(frame: Frame) -> list[ProxyEndpoint]:
    return [p for p in frame.proxies if frame.time - (p.last_heartbeat_time or 0) <= PROXY_TTL_S]


def service_rows(frame: Frame) -> list[ServiceRow]:
    """Every service with its live replicas (from heartbeats), sorted by name."""
    beats = [b for b in frame.services if frame.time - b.time <= LIVE_S]
    runners, proxies = live_workers(frame), live_proxies(frame)
    running = sum(int(w.metadata.get("running", 0)) for w in runners)
    slots = sum(int(w.metadata.get("concurrency", 0)) for w in runners)
    details = {
        "runner": f"{len(runners)} worker(s), {running}/{slots} slots busy",
        "llm-proxy": ", ".join(sorted({str(p.model_version or "?") for p in proxies})),
    }
    rows = dict(Counter(b.service for b in beats))
    rows["runner"] = max(rows.get("runner", 0), len(runners))  # runners also beat as workers
    rows["llm-proxy"] = len(proxies)  # proxies beat in their own registry
    for name in EXPECTED_SERVICES:
        rows.setdefault(name, 0)
    out = []
    for name, n in sorted(rows.items()):
        ports = sorted(b.port for b in beats if b.service == name and b.port)
        detail = details.get(name, "") or (f"ports {', '.join(map(str, ports))}" if ports else "")
        out.append(ServiceRow(name, n, detail))
    return out


@dataclass(frozen=True, slots=True)
class ReplicaLiveness:
    """Whether an inference replica's state is still kept by its vllm-sync, and if not why it is not."""

    gone: bool
    detail: str = ""


def replica_liveness(frame: Frame) -> dict[str, ReplicaLiveness]:
    """Per replica URL: gone when its state has not changed for ``LIVE_S`` and no vllm-sync beats.
    vllm-sync writes the state only when it changes, so an old state alone is no sign of a stop;
    with no vllm-sync left, nothing keeps the record true and it must not read as serving."""
    syncing = any(b.service == "vllm-sync" and frame.time - b.time <= LIVE_S for b in frame.services)
    out = {}
    for r in frame.replicas:
        age_s = frame.time - (r.updated_time or 0)
        gone = age_s > LIVE_S and not syncing
        out[r.url] = ReplicaLiveness(gone, f"no vllm-sync running; last update {age_s:.0f} s ago" if gone else "")
    return out


def rate(now: Frame, before: Frame | None, value: Callable[[Frame], float]) -> float | None:
    """Per second between two frames; None without an earlier frame. Never negative: streams may be
    trimmed between the two reads."""
    if before is None or now.time <= before.time:
        return None
    return max(value(now) - value(before), 0) / (now.time - before.time)


# The counters both views show with a rate: (label, how to read it from a frame).
COUNTERS: tuple[tuple[str, Callable[[Frame], float]], ...] = (
    ("succeeded", lambda f: f.snap.rollouts["succeeded"]),
    ("failed", lambda f: f.snap.rollouts["failed"]),
    ("cancelled", lambda f: f.snap.rollouts["cancelled"]),
    ("finished", lambda f: f.snap.stream_lengths["finished"]),
    ("samples", lambda f: f.adapter.get("samples", 0)),
    ("dead letters", lambda f: f.snap.stream_lengths["dead_letters"]),
    ("trainer steps", lambda f: f.steps[-1].step if f.steps else 0),
)
