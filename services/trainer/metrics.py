"""The trainer's step metrics: one record per step on the trainer's steps stream (on the leader), the last
step's numbers as Prometheus gauges labelled by rank, and a local JSON-lines mirror.

The gauges live in this object's own registry, served by `fulmen.telemetry.http`.
More: docs/design/trainer.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from fulmen.store import RedisStore
from fulmen.telemetry.steps import append_step, summarize

log = logging.getLogger(__name__)


class StepMetrics:
    def __init__(self, rank: int, port: int | None = None) -> None:
        self.rank = str(rank)
        self.registry = CollectorRegistry()
        self.gauges: dict[str, Gauge] = {}
        self.step = Gauge("fulmen_trainer_step", "Optimizer steps taken", ["rank"], registry=self.registry)
        self.store: RedisStore | None = None
        self.port = port
        if port is not None:
            start_http_server(port, registry=self.registry)
            log.info("trainer rank %s: /metrics on port %d", self.rank, port)
        self._writes: dict[asyncio.Task[None], None] = {}  # in flight, in order (a dict keeps it)

    def log_steps_to(self, store: RedisStore) -> None:
        """Also append each step's record to the store's steps stream (the leader only)."""
        self.store = store

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        self.step.labels(self.rank).set(step)
        for key, value in metrics.items():
            if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name = "fulmen_trainer_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            gauge = self.gauges.get(name)
            if gauge is None:
                gauge = self.gauges[name] = Gauge(name, f"trainer metric {key}", ["rank"], registry=self.registry)
            gauge.labels(self.rank).set(value)
        if self.store is not None:
            # fire and forget, on the trainer's loop: the step must not wait for a diagnostic write;
            # each write waits for the one before, so the log keeps the steps in order
            previous = next(reversed(self._writes), None)
            task = asyncio.get_running_loop().create_task(self._append(step, metrics, previous))
            self._writes[task] = None
            task.add_done_callback(lambda t: self._writes.pop(t, None))

    async def flush(self) -> None:
        """Wait for the summaries in flight to be written (or to have failed)."""
        if self._writes:
            await asyncio.wait(list(self._writes))

    async def _append(self, step: int, metrics: dict[str, Any], previous: asyncio.Task[None] | None) -> None:
        assert self.store is not None
        if previous is not None:
            await asyncio.wait([previous])
        try:
            await append_step(self.store.redis, self.store.keys, summarize(step, metrics, time.time()))
        except Exception as e:  # the curve may miss a point; training goes on
            log.warning("step %d: could not log the step summary: %s", step, type(e).__name__)


class MetricsMirror:
    """The JSON-lines file of every step's full metrics: a local mirror, each step written once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last_step: int | None = None  # the file's last step, read on first use

    def append(self, lines: list[dict[str, Any]]) -> None:
        """Append the lines of steps the file does not have yet."""
        if self._last_step is None:  # once per process
            self._last_step = 0
            if self.path.exists():
                with self.path.open() as f:
                    for raw in f:
                        if raw.strip():
                            self._last_step = max(self._last_step, int(json.loads(raw)["step"]))
        new = [line for line in lines if line["step"] > self._last_step]
        if not new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for line in new:
                f.write(json.dumps(line) + "\n")
        self._last_step = new[-1]["step"]
