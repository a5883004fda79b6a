"""`fulmen top`: a live terminal view of one experiment's whole pipeline, refreshed in place.

Reads `fulmen.telemetry.pipeline` frames from Redis, so it runs from any machine that reaches it. More:
docs/design/telemetry.md.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from typing import Any

import redis
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from fulmen import keys as k
from fulmen.serving.rewards import rewards_by_version
from fulmen.telemetry.pipeline import COUNTERS, Frame, rate, read_frame, service_rows
from fulmen.versions.model_version import ModelVersion

VERSIONS_SHOWN = 4  # newest versions on the reward-by-version line

BARS = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 60


def sparkline(values: Sequence[float]) -> str:
    """One character per value, scaled between the smallest and the largest."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low
    return "".join(BARS[0 if span == 0 else min(len(BARS) - 1, int((v - low) / span * len(BARS)))] for v in values)


def _rate(now: Frame, before: Frame | None, value: Any) -> str:
    per_s = rate(now, before, value)
    return "-" if per_s is None else f"{per_s:.1f}/s"


def _services_table(frame: Frame) -> Table:
    table = Table("service", "live", "detail", title="services", title_justify="left")
    for row in service_rows(frame):
        table.add_row(row.name, str(row.live), row.detail, style=None if row.live else "dim")
    return table


def _pipeline_table(frame: Frame, before: Frame | None) -> Table:
    snap = frame.snap
    table = Table(show_header=False, title="pipeline", title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_column("rate", justify="right")
    table.add_row("queue depth", str(snap.queue_depth), "")
    table.add_row("  by lane", ", ".join(f"{lane} {n}" for lane, n in snap.queue_depth_by_lane.items()), "")
    table.add_row("active attempts", str(snap.active_attempts), "")
    for label, value in COUNTERS:
        if label == "trainer steps":
            continue  # on the reward line
        indent = "  " if label in ("succeeded", "failed", "cancelled") else ""
        table.add_row(f"{indent}{label}", str(int(value(frame))), _rate(frame, before, value))
    for (stream, group), info in sorted(snap.groups.items()):
        lag = f"lag {info.lag_s:.1f}s" if info.lag_s else ""
        table.add_row(f"pending {group} ({stream})", str(info.pending), lag)
    for mode, by in rewards_by_version(frame.adapter).items():  # rollback and A/B: how each version does
        newest = sorted(by.items(), key=lambda kv: ModelVersion.parse(kv[0]).number)[-VERSIONS_SHOWN:]
        cells = ", ".join(f"{v} {r['mean_reward']:.2f}" for v, r in newest)
        table.add_row(f"{mode} reward by version", cells, "")
    return table


def render(frame: Frame | None, before: Frame | None, experiment: str, error: str | None = None) -> RenderableType:
    stamp = time.strftime("%H:%M:%S")
    if frame is None:
        return Text(f"fulmen top — experiment {experiment} — {stamp}\n{error or 'no data yet'}")
    version = frame.model_version
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
        console.print(render(read_frame(client, keys, SPARK_POINTS), None, experiment))
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
                    before, frame = frame, read_frame(client, keys, SPARK_POINTS)
                except (redis.RedisError, OSError) as e:
                    error = f"redis unreachable: {type(e).__name__}"
                live.update(render(frame, before, experiment, error), refresh=True)
                time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0
