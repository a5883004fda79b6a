"""Prometheus metrics of one proxy process, served on ``/metrics`` in the text format.

Multi-process with ``PROMETHEUS_MULTIPROC_DIR``; label children are cached. Why:
docs/design/proxy.md.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # the process's CPU, memory, fds and GC, as every Fulmen service reports them (fulmen.telemetry.http)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter(
            "fulmen_proxy_requests",
            "Requests by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "fulmen_proxy_request_seconds", "Time to the last byte, by endpoint.", ["endpoint"],
            buckets=_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "fulmen_proxy_tokens", "Tokens served, prompt and completion.", ["kind"], registry=r
        )
        self.in_flight = Gauge(
            "fulmen_proxy_in_flight", "Completions being served now.", registry=r, multiprocess_mode="livesum"
        )
        self.model_version = Gauge(
            "fulmen_proxy_model_version", "1 for the model version being served.", ["model_version"],
            registry=r, multiprocess_mode="liveall",
        )  # fmt: skip
        self.unattributed = Counter(
            "fulmen_proxy_unattributed_requests",
            "Completions with no rollout attempt: served, no span.",
            registry=r,
        )
        self.span_failures = Counter(
            "fulmen_proxy_span_failures", "Spans that could not be stored, by reason.", ["reason"], registry=r
        )
        self.weight_loads = Counter(
            "fulmen_proxy_weight_loads", "Model versions loaded.", ["outcome"], registry=r
        )
        self._requests: dict[tuple[str, int], Counter] = {}
        self._latency: dict[str, Histogram] = {}
        self._version = ""
        self.prompt_tokens = self.tokens.labels("prompt")
        self.completion_tokens = self.tokens.labels("completion")

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        key = (endpoint, status)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = self.requests.labels(endpoint, str(status))
        counter.inc()
        histogram = self._latency.get(endpoint)
        if histogram is None:
            histogram = self._latency[endpoint] = self.latency.labels(endpoint)
        histogram.observe(seconds)

    def set_model_version(self, version: str) -> None:
        if version == self._version:
            return
        if self._version:
            self.model_version.labels(self._version).set(0)
        self.model_version.labels(version).set(1)
        self._version = version

    def render(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
