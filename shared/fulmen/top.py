"""`fulmen top`: a live terminal view of one experiment's whole pipeline, refreshed in place.

Everything comes from Redis, so it runs from any machine that reaches it: the pipeline snapshot
(`fulmen.store.statistics`), the services' heartbeats (`fulmen.ops_http`), the runners' worker
records, the proxies' registry, the adapter's counters and the trainer's step log (the reward curve).
Rates are deltas between two refreshes, so the first frame (and ``--once``) has none.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from fulmen import keys as k
from fulmen.errors import RecordError
from fulmen.ops_http import HEARTBEAT_S
from fulmen.records import ProxyEndpoint, ServiceBeat, TrainStep, Worker
from fulmen.store.registry import PROXY_TTL_S
from fulmen.store.statistics import Snapshot, read_snapshot
from fulmen.train_steps import read_steps

LIVE_S = 3 * HEARTBEAT_S  # a heartbeat older than this: the process is gone (or stuck)
BARS = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 60


def sparkline(values: Sequence[float]) -> str:
    """One character per value, scaled between the smallest and the largest."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low
    return "".join(BARS[0 if span == 0 else min(len(BARS) - 1, int((v - low) / span * len(BARS)))] for v in values)


@dataclass
class Frame:
    """What one refresh read from Redis."""

    time: float
    snap: Snapshot
    services: list[ServiceBeat]
    workers: list[Worker]
    proxies: list[ProxyEndpoint]
    adapter: dict[str, int]
    algorithm: dict[str, str]
    steps: list[TrainStep]


def _records(raw: dict[bytes, bytes], decode: Any) -> list[Any]:
    out = []
    for value in raw.values():
        try:
            out.append(decode(value))
        except RecordError:
            continue  # one bad entry must not blank the screen
    return out


def read_frame(client: redis.Redis, keys: k.Keys) -> Frame:
    snap = read_snapshot(client, keys)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.services)
    pipe.hgetall(keys.workers)
    pipe.hgetall(keys.proxies)
    pipe.hgetall(keys.adapter_stats)
    pipe.hgetall(keys.algorithm_state)
    services, workers, proxies, adapter, algorithm = pipe.execute()
    return Frame(
        snap.server_time,
        snap,
        _records(services, ServiceBeat.from_wire),
        _records(workers, Worker.from_wire),
        _records(proxies, ProxyEndpoint.from_wire),
        {key.decode(): int(v) for key, v in adapter.items() if v.isdigit()},
        {key.decode(): v.decode(errors="replace") for key, v in algorithm.items()},
        read_steps(client, keys, SPARK_POINTS),
    )


def _rate(now: Frame, before: Frame | None, value: Any) -> str:
    if before is None or now.time <= before.time:
        return "-"
    delta = value(now) - value(before)
    return f"{max(delta, 0) / (now.time - before.time):.1f}/s"  # streams may be trimmed: never negative


def _services_table(frame: Frame) -> Table:
    now = frame.time
    table = Table("service", "live", "detail", title="services", title_justify="left")
    beats = [b for b in frame.services if now - b.time <= LIVE_S]
    live = Counter(b.service for b in beats)
    runners = [w for w in frame.workers if w.status != "stopped" and now - (w.last_heartbeat_time or 0) <= LIVE_S]
    proxies = [p for p in frame.proxies if now - (p.last_heartbeat_time or 0) <= PROXY_TTL_S]
    running = sum(int(w.metadata.get("running", 0)) for w in runners)
    slots = sum(int(w.metadata.get("concurrency", 0)) for w in runners)
    details = {
        "runner": f"{len(runners)} worker(s), {running}/{slots} slots busy",
        "llm-proxy": ", ".join(sorted({str(p.model_version or "?") for p in proxies})) or "",
    }
    rows = dict(live)
    rows["runner"] = max(rows.get("runner", 0), len(runners))  # runners also beat as workers
    rows["llm-proxy"] = len(proxies)  # proxies beat in their own registry
    for name in ("runner", "llm-proxy", "adapter", "trainer", "algorithm", "evaluator", "watchdog"):
        rows.setdefault(name, 0)
    for name, n in sorted(rows.items()):
        ports = sorted(b.port for b in beats if b.service == name and b.port)
        detail = details.get(name, "") or (f"ports {', '.join(map(str, ports))}" if ports else "")
        table.add_row(name, str(n), detail, style=None if n else "dim")
    return table


def _pipeline_table(frame: Frame, before: Frame | None) -> Table:
    snap = frame.snap
    table = Table(show_header=False, title="pipeline", title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_column("rate", justify="right")
    table.add_row("queue depth", str(snap.queue_depth), "")
    table.add_row("active attempts", str(snap.active_attempts), "")
    for status in ("succeeded", "failed", "cancelled"):
        table.add_row(f"  {status}", str(snap.rollouts[status]), _rate(frame, before, lambda f, s=status: f.snap.rollouts[s]))
    table.add_row("finished", str(snap.stream_lengths["finished"]),
                  _rate(frame, before, lambda f: f.snap.stream_lengths["finished"]))
    table.add_row("samples", str(frame.adapter.get("samples", 0)), _rate(frame, before, lambda f: f.adapter.get("samples", 0)))
    table.add_row("dead letters", str(snap.stream_lengths["dead_letters"]),
                  _rate(frame, before, lambda f: f.snap.stream_lengths["dead_letters"]))
    for (stream, group), info in sorted(snap.groups.items()):
        lag = f"lag {info.lag_s:.1f}s" if info.lag_s else ""
        table.add_row(f"pending {group} ({stream})", str(info.pending), lag)
    return table


def render(frame: Frame | None, before: Frame | None, experiment: str, error: str | None = None) -> RenderableType:
    stamp = time.strftime("%H:%M:%S")
    if frame is None:
        return Text(f"fulmen top — experiment {experiment} — {stamp}\n{error or 'no data yet'}")
    version = frame.snap.model_version or "-"
    head = Text.assemble(
        ("fulmen top", "bold"), f" — experiment {experiment} — model version ", (version, "bold"), f" — {stamp}",
    )
    if error:
        head.append(f"  ({error}; showing the last frame)", style="red")
    steps = frame.steps
    rewards = [s.reward_mean for s in steps if s.reward_mean is not None]
    if steps:
        last = steps[-1]
        curve = Text.assemble(
            f"reward over the last {len(rewards)} steps  ", (sparkline(rewards), "green"),
            f"  step {last.step}, reward {last.reward_mean if last.reward_mean is not None else '-'}",
            f", {_rate(frame, before, lambda f: f.steps[-1].step if f.steps else 0)} steps" if before else "",
        )
    else:
        curve = Text("reward: no trainer step yet", style="dim")
    algo = frame.algorithm
    algo_line = Text(
        f"algorithm: epoch {algo.get('epoch', '-')}, groups {algo.get('groups', '-')}, "
        f"rollouts enqueued {algo.get('enqueued', '-')}"
    ) if algo else Text("algorithm: not started", style="dim")
    return Group(head, _pipeline_table(frame, before), _services_table(frame), curve, algo_line)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run(client: redis.Redis, experiment: str, interval_s: float, once: bool, console: Any) -> int:
    """Draw once, or until interrupted; returns the exit code."""
    keys = k.Keys(experiment)
    if once:
        console.print(render(read_frame(client, keys), None, experiment))
        return 0
    from rich.live import Live

    signal.signal(signal.SIGTERM, _interrupt)  # leave like Ctrl-C: restore the cursor, exit 0
    before: Frame | None = None
    frame: Frame | None = None
    try:
        with Live(render(None, None, experiment), console=console, auto_refresh=False) as live:
            while True:
                error = None
                try:
                    before, frame = frame, read_frame(client, keys)
                except (redis.RedisError, OSError) as e:
                    error = f"redis unreachable: {type(e).__name__}"
                live.update(render(frame, before, experiment, error), refresh=True)
                time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0
