"""What bench/e2e.py and bench/tool_demo.py share: a demo's Procfile and .env started by `honcho start`
in a fresh folder on free ports, its validation passes read from the store as they land, honcho
stopped as Ctrl-C would, and the reward curves drawn."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from fulmen.keys import Keys
from fulmen.store.redis.embedded import free_port

ROOT = Path(__file__).resolve().parents[1]
HONCHO = str(Path(sys.executable).with_name("honcho"))


def variant_names(parser: argparse.ArgumentParser, text: str, variants: dict[str, Any]) -> list[str]:
    """The comma-separated --variants, each one of ``variants`` (else a usage error)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in variants]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(variants)}")
    return names


def write_folder(folder: Path, procfile: str, env_file: str, overrides: dict[str, str]) -> int:
    """The repository's ``procfile`` and ``env_file`` in ``folder`` (as Procfile and .env), on a free
    Redis and proxy port, metrics off, ``overrides`` last. The Redis port."""
    shutil.copy(ROOT / procfile, folder / "Procfile")
    redis_port = free_port()
    overrides = {"FULMEN_REDIS_PORT": str(redis_port), "FULMEN_PROXY_PORT": str(free_port()),
                 "FULMEN_METRICS_PORT": "0", **overrides}
    lines = [x for x in (ROOT / env_file).read_text().splitlines() if x.split("=", 1)[0] not in overrides]
    (folder / ".env").write_text("\n".join([*lines, *(f"{k}={v}" for k, v in overrides.items())]) + "\n")
    return redis_port


def clean_env() -> dict[str, str]:
    """This process's environment without its FULMEN_* settings and REDIS_URL (the folder's .env
    decides them), with the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    return env


@contextmanager
def honcho_start(folder: Path, env: dict[str, str], argv: list[str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`honcho start` (or ``argv``, which runs honcho: `fulmen start RUN.yaml`) in ``folder`` (its output
    in honcho.log there), stopped on exit if still running."""
    with open(folder / "honcho.log", "w") as log:
        honcho = subprocess.Popen(argv or [HONCHO, "start"], cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        yield honcho
    finally:
        if honcho.poll() is None:
            os.killpg(honcho.pid, signal.SIGINT)  # as Ctrl-C would: honcho stops every service
            try:
                honcho.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(honcho.pid, signal.SIGKILL)


def log_tail(folder: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of the honcho.log in ``folder`` (why a run ended early)."""
    path = folder / "honcho.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no honcho.log)"


def _validations(client: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    try:
        return [json.loads(fields[b"m"]) for _, fields in client.xrange(keys.validations)]
    except redis.RedisError:  # not up yet
        return []


def watch_validations(honcho: subprocess.Popen[bytes], redis_port: int, name: str, started: float,
                      budget_s: float, done: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    """The validation passes of experiment "default", logged as they land, until ``done(passes)``,
    honcho ends or ``budget_s`` since ``started`` is spent."""
    client = redis.Redis(port=redis_port, socket_connect_timeout=1)
    keys = Keys("default")
    passes: list[dict[str, Any]] = []
    while time.time() - started < budget_s and honcho.poll() is None:
        time.sleep(2.0)
        # the run's Redis ends with the run: keep what was read, a read after the end finds nothing
        latest = _validations(client, keys)
        for v in latest[len(passes):]:
            print(f"  {name}: {v['label']} accuracy {v['accuracy']:.3f} at {v['time'] - started:.0f} s",
                  file=sys.stderr, flush=True)
        passes = latest if len(latest) >= len(passes) else passes
        if done(passes):
            break
    return passes


def curve(passes: list[dict[str, Any]], started: float) -> list[dict[str, Any]]:
    """The passes as points of the reward curve: seconds since ``started``."""
    return [{"label": v["label"], "step": v.get("step"), "accuracy": v["accuracy"],
             "seconds": round(v["time"] - started, 1)} for v in passes]


def plot(results: list[dict[str, Any]], path: Path, ylabel: str, target: float | None = None) -> None:
    """Each variant's curve, accuracy over minutes since `honcho start`; ``target`` as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([c["seconds"] / 60 for c in r["curve"]], [c["accuracy"] for c in r["curve"]], marker="o",
                label=r["variant"])
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="minutes since `honcho start`", ylabel=ylabel, ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
