"""The tool-use demo end to end: held-out accuracy from `honcho -f Procfile.tools -e .env.tools start`,
with GRPO on, and the same run with GRPO off (the trainer's learning rate 0: FULMEN_LEARNING_RATE=0
and FULMEN_LR_FINAL=0; every service runs and the trainer steps, but the weights never change).

Each variant is the repository's Procfile.tools and .env.tools, every service a process, the warm
start prepared from scratch (SFT, inside the clock), in a fresh folder on free ports. Validation
passes (held-out calculator tasks, greedy, the whole agent loop) are read from the store as they
land; a variant ends when its run ends by itself or at --budget-s.

    python bench/tool_demo.py                       # grpo then grpo_off: up to 2 x 15 min
    python bench/tool_demo.py --variants grpo --budget-s 600
    python bench/tool_demo.py --warm-start /tmp/tools-warm   # both variants from one warm start

With --warm-start DIR the SFT warm start is prepared once into DIR (or taken from it when prepared
before) outside the clock, and each variant starts from a copy of it: both variants then start from
the same weights, and the minutes count GRPO only (the SFT's seconds are reported beside them).

Prints one JSON line per variant, then (last) one JSON object with the figures: held-out accuracy
at the start (v0, the warm start) and at the end for both, the gain, and minutes; draws the curves
into --plot (bench/tool-demo-curves.png)."""

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
    "grpo": {},
    "grpo_off": {"FULMEN_LEARNING_RATE": "0", "FULMEN_LR_FINAL": "0"},
}


def _validations(client: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    try:
        return [json.loads(fields[b"m"]) for _, fields in client.xrange(keys.validations)]
    except redis.RedisError:  # not up yet
        return []


def run_variant(name: str, budget_s: float, folder: Path, extra: dict[str, str],
                warm_start: Path | None = None) -> dict[str, Any]:
    shutil.copy(ROOT / "Procfile.tools", folder / "Procfile")
    if warm_start is not None:  # where .env.tools's FULMEN_MODEL_DIR points: the demo reuses it as prepared
        shutil.copytree(warm_start, folder / ".fulmen" / "demo-tools")
    redis_port = free_port()
    overrides = {"FULMEN_REDIS_PORT": str(redis_port), "FULMEN_PROXY_PORT": str(free_port()),
                 "FULMEN_METRICS_PORT": "0", "FULMEN_DASHBOARD_PORT": str(free_port()), **extra, **VARIANTS[name]}
    lines = [x for x in (ROOT / ".env.tools").read_text().splitlines() if x.split("=", 1)[0] not in overrides]
    (folder / ".env").write_text("\n".join([*lines, *(f"{k}={v}" for k, v in overrides.items())]) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    client = redis.Redis(port=redis_port, socket_connect_timeout=1)
    keys = Keys("default")
    started = time.time()
    with open(folder / "honcho.log", "w") as log:
        honcho = subprocess.Popen([HONCHO, "start"], cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    passes: list[dict[str, Any]] = []
    try:
        while time.time() - started < budget_s and honcho.poll() is None:
            time.sleep(2.0)
            # the run's Redis ends with the run: keep what was read, a read after the end finds nothing
            latest = _validations(client, keys)
            for v in latest[len(passes):]:
                print(f"  {name}: {v['label']} accuracy {v['accuracy']:.3f} at {v['time'] - started:.0f} s",
                      file=sys.stderr, flush=True)
            passes = latest if len(latest) >= len(passes) else passes
        curve = [{"label": v["label"], "step": v.get("step"), "accuracy": v["accuracy"],
                  "seconds": round(v["time"] - started, 1)} for v in passes]
    finally:
        if honcho.poll() is None:
            os.killpg(honcho.pid, signal.SIGINT)  # as Ctrl-C would: honcho stops every service
            try:
                honcho.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(honcho.pid, signal.SIGKILL)
    text = (folder / "honcho.log").read_text(errors="replace")
    warm = next((c["accuracy"] for c in curve if c["label"] == "v0"), None)
    later = [c for c in curve if c["label"] != "v0"]
    return {
        "variant": name, "budget_s": budget_s,
        "start_accuracy": warm,
        "end_accuracy": later[-1]["accuracy"] if later else warm,
        "best_accuracy": max((c["accuracy"] for c in later), default=warm),
        "end_step": later[-1]["step"] if later else 0,
        "minutes": round((time.time() - started) / 60, 2),
        "warm_start_done_s": next((c["seconds"] for c in curve if c["label"] == "v0"), None),
        "tool_errors_logged": text.count("tool_error"), "curve": curve,
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([c["seconds"] / 60 for c in r["curve"]], [c["accuracy"] for c in r["curve"]], marker="o",
                label=r["variant"])
    ax.set(xlabel="minutes since `honcho start`", ylabel="held-out accuracy (greedy, with the tool)", ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="grpo,grpo_off", help="Comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--budget-s", type=float, default=900.0, help="Most seconds per variant (15 min).")
    parser.add_argument("--set", action="append", default=[], metavar="FULMEN_X=V",
                        help="Override a setting of .env.tools for every variant (repeatable).")
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="Prepare the warm start once into this folder (or reuse it) and start every variant from it.")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "tool-demo-curves.png")
    args = parser.parse_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    extra = dict(item.split("=", 1) for item in args.set)
    figures: dict[str, Any] = {"budget_s": args.budget_s, "plot": str(args.plot)}
    if args.warm_start is not None:
        from fulmen_algorithm.tool_demo import prepare_tool_demo

        started = time.time()
        prepare_tool_demo(args.warm_start.resolve(), seed=0)
        figures["warm_start_s"] = round(time.time() - started, 1)  # ~0 when it was prepared before
        print(f"warm start in {args.warm_start} ({figures['warm_start_s']} s)", file=sys.stderr, flush=True)
    results = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"fulmen-tools-{name}-") as folder:
            print(f"{name}: honcho start in {folder} (budget {args.budget_s:.0f} s)", file=sys.stderr, flush=True)
            result = run_variant(name, args.budget_s, Path(folder), extra, args.warm_start)
        print(json.dumps(result), flush=True)
        results.append(result)
    plot(results, args.plot)
    for r in results:
        for field in ("start_accuracy", "end_accuracy", "best_accuracy", "end_step", "minutes"):
            figures[f"{r['variant']}_{field}"] = r[field]
        if r["start_accuracy"] is not None and r["end_accuracy"] is not None:
            figures[f"{r['variant']}_gain"] = round(r["end_accuracy"] - r["start_accuracy"], 3)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
