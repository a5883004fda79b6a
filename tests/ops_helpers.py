"""Helpers for the operations tests: services as processes, scraping their endpoints."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from procs import stop  # noqa: F401  (the ops tests import it from here)
from prometheus_client.parser import text_string_to_metric_families

FULMEN = str(Path(sys.executable).with_name("fulmen"))
ROOT = Path(__file__).resolve().parents[1]


def service_env(redis_url: str, experiment: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment every service of one test run shares (no FULMEN_METRICS_PORT: each process
    gets its own $PORT, as under honcho)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PORT", "FULMEN_METRICS_PORT")}
    return {**env, "REDIS_URL": redis_url, "FULMEN_EXPERIMENT": experiment, "PYTHONPATH": str(ROOT),
            "FULMEN_DATA_DIR": str(tmp_path / "data"), **extra}


def start(args: Sequence[str], env: dict[str, str], port: int | None = None) -> subprocess.Popen[bytes]:
    env = dict(env) if port is None else {**env, "PORT": str(port)}
    return subprocess.Popen([FULMEN, *args], env=env, cwd=ROOT)


def get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """(status, body); (0, reason) when nothing answers yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text as {(sample name, labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(parsed: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float | None:
    return parsed.get((name, frozenset(labels.items())))


def wait_for(check: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.5) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)
