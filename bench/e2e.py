"""Wall-clock from `honcho start` to the demo's accuracy target: asynchronous (staleness 1) against
synchronous (staleness 0) training, and the same run with GRPO switched off (learning rate 0: the
warm start, served and validated the same way for the same time).

Each variant is the README's demo — the repository's Procfile and .env, every service a process —
in a fresh folder on free ports. Validation passes (300 held-out questions, greedy) are read from
the store as they land; a variant ends at the first pass at or above --target, or at --budget-s.

    python bench/e2e.py                              # async, sync, grpo_off: up to 3 x 15 min
    python bench/e2e.py --variants async --budget-s 900

Prints one JSON line per variant, then one JSON object with every figure; draws the curves into
--plot (bench/e2e-curves.png)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from fulmen.embedded import free_port
from fulmen.keys import Keys

ROOT = Path(__file__).resolve().parents[1]
HONCHO = str(Path(sys.executable).with_name("honcho"))
VARIANTS: dict[str, dict[str, str]] = {
    "async": {"FULMEN_STALENESS": "1"},
    "sync": {"FULMEN_STALENESS": "0"},
    "grpo_off": {"FULMEN_STALENESS": "1", "FULMEN_LEARNING_RATE": "0", "FULMEN_LR_FINAL": "0"},
}


def _validations(client: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    try:
        return [json.loads(fields[b"m"]) for _, fields in client.xrange(keys.validations)]
    except redis.RedisError:  # not up yet
        return []


def run_variant(name: str, target: float, budget_s: float, folder: Path) -> dict[str, Any]:
    shutil.copy(ROOT / "Procfile", folder / "Procfile")
    redis_port = free_port()
    overrides = {"FULMEN_REDIS_PORT": str(redis_port), "FULMEN_PROXY_PORT": str(free_port()),
                 "FULMEN_METRICS_PORT": "0", "FULMEN_TOTAL_STEPS": "100000", **VARIANTS[name]}
    lines = [x for x in (ROOT / ".env").read_text().splitlines() if x.split("=", 1)[0] not in overrides]
    (folder / ".env").write_text("\n".join([*lines, *(f"{k}={v}" for k, v in overrides.items())]) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    client = redis.Redis(port=redis_port, socket_connect_timeout=1)
    keys = Keys("default")
    started = time.time()
    with open(folder / "honcho.log", "w") as log:
        honcho = subprocess.Popen([HONCHO, "start"], cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    reached: dict[str, Any] | None = None
    seen = 0
    try:
        while time.time() - started < budget_s and honcho.poll() is None:
            time.sleep(2.0)
            passes = _validations(client, keys)
            for v in passes[seen:]:
                print(f"  {name}: {v['label']} accuracy {v['accuracy']:.3f} at {v['time'] - started:.0f} s",
                      file=sys.stderr, flush=True)
            seen = len(passes)
            reached = next((v for v in passes if v["label"] != "v0" and v["accuracy"] >= target), None)
            if reached is not None:
                break
        curve = [{"label": v["label"], "step": v.get("step"), "accuracy": v["accuracy"],
                  "seconds": round(v["time"] - started, 1)} for v in _validations(client, keys)]
    finally:
        os.killpg(honcho.pid, signal.SIGINT)  # as Ctrl-C would: honcho stops every service
        try:
            honcho.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(honcho.pid, signal.SIGKILL)
    warm = next((c["accuracy"] for c in curve if c["label"] == "v0"), None)
    return {
        "variant": name, "target": target, "budget_s": budget_s,
        "time_to_target_s": round(reached["time"] - started, 1) if reached else None,
        "steps_to_target": reached.get("step") if reached else None,
        "warm_start_accuracy": warm,
        "best_accuracy": max((c["accuracy"] for c in curve if c["label"] != "v0"), default=None),
        "last_accuracy": curve[-1]["accuracy"] if curve else None,
        "wall_s": round(time.time() - started, 1), "curve": curve,
    }


def plot(results: list[dict[str, Any]], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([c["seconds"] / 60 for c in r["curve"]], [c["accuracy"] for c in r["curve"]], marker="o",
                label=r["variant"])
    ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="minutes since `honcho start`", ylabel="validation accuracy (300, greedy)", ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="async,sync,grpo_off", help="Comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--target", type=float, default=0.9, help="Validation accuracy to reach.")
    parser.add_argument("--budget-s", type=float, default=900.0, help="Most seconds per variant (15 min).")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "e2e-curves.png")
    args = parser.parse_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    results = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"fulmen-e2e-{name}-") as folder:
            print(f"{name}: honcho start in {folder} (budget {args.budget_s:.0f} s)", file=sys.stderr, flush=True)
            result = run_variant(name, args.target, args.budget_s, Path(folder))
        print(json.dumps(result), flush=True)
        results.append(result)
    plot(results, args.plot, args.target)
    figures: dict[str, Any] = {"target": args.target, "budget_s": args.budget_s, "plot": str(args.plot)}
    for r in results:
        for field in ("time_to_target_s", "steps_to_target", "warm_start_accuracy", "best_accuracy", "last_accuracy"):
            figures[f"{r['variant']}_{field}"] = r[field]
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
