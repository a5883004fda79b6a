"""The trainer's Prometheus `/metrics`: the last step's numbers as gauges, labelled by rank.

Served on ``metrics_port`` (else $PORT, which honcho gives every process; else not at all), so
`honcho start -c trainer=2` gives each rank its own port."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

log = logging.getLogger(__name__)


class StepMetrics:
    def __init__(self, rank: int, port: int | None) -> None:
        self.rank = str(rank)
        self.registry = CollectorRegistry()
        self.gauges: dict[str, Gauge] = {}
        self.step = Gauge("fulmen_trainer_step", "Optimizer steps taken", ["rank"], registry=self.registry)
        port = port if port is not None else (int(os.environ["PORT"]) if os.environ.get("PORT") else None)
        self.port = port
        if port is not None:
            start_http_server(port, registry=self.registry)
            log.info("trainer rank %s: /metrics on port %d", self.rank, port)

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
