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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import honcho_demo as run

from fulmen.store.redis.embedded import free_port

VARIANTS: dict[str, dict[str, str]] = {
    "grpo": {},
    "grpo_off": {"FULMEN_LEARNING_RATE": "0", "FULMEN_LR_FINAL": "0"},
}


def run_variant(name: str, budget_s: float, folder: Path, extra: dict[str, str],
                warm_start: Path | None = None) -> dict[str, Any]:
    redis_port = run.write_folder(folder, "Procfile.tools", ".env.tools",
                                  {"FULMEN_DASHBOARD_PORT": str(free_port()), **extra, **VARIANTS[name]})
    if warm_start is not None:  # where .env.tools's FULMEN_MODEL_DIR points: the demo reuses it as prepared
        shutil.copytree(warm_start, folder / ".fulmen" / "demo-tools")
    env = run.clean_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    started = time.time()
    with run.honcho_start(folder, env) as honcho:
        passes = run.watch_validations(honcho, redis_port, name, started, budget_s, lambda _: False)
    points = run.curve(passes, started)
    text = (folder / "honcho.log").read_text(errors="replace")
    warm = next((c["accuracy"] for c in points if c["label"] == "v0"), None)
    later = [c for c in points if c["label"] != "v0"]
    return {
        "variant": name, "budget_s": budget_s,
        "start_accuracy": warm,
        "end_accuracy": later[-1]["accuracy"] if later else warm,
        "best_accuracy": max((c["accuracy"] for c in later), default=warm),
        "end_step": later[-1]["step"] if later else 0,
        "minutes": round((time.time() - started) / 60, 2),
        "warm_start_done_s": next((c["seconds"] for c in points if c["label"] == "v0"), None),
        "tool_errors_logged": text.count("tool_error"), "curve": points,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="grpo,grpo_off", help="Comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--budget-s", type=float, default=900.0, help="Most seconds per variant (15 min).")
    parser.add_argument("--set", action="append", default=[], metavar="FULMEN_X=V",
                        help="Override a setting of .env.tools for every variant (repeatable).")
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="Prepare the warm start once into this folder (or reuse it) and start every variant from it.")
    parser.add_argument("--plot", type=Path, default=run.ROOT / "bench" / "tool-demo-curves.png")
    args = parser.parse_args()
    names = run.variant_names(parser, args.variants, VARIANTS)
    extra = dict(item.split("=", 1) for item in args.set)
    figures: dict[str, Any] = {"budget_s": args.budget_s, "plot": str(args.plot)}
    if args.warm_start is not None:
        from fulmen_algorithm.demos.tools import prepare_tool_demo

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
    run.plot(results, args.plot, "held-out accuracy (greedy, with the tool)")
    for r in results:
        for field in ("start_accuracy", "end_accuracy", "best_accuracy", "end_step", "minutes"):
            figures[f"{r['variant']}_{field}"] = r[field]
        if r["start_accuracy"] is not None and r["end_accuracy"] is not None:
            figures[f"{r['variant']}_gain"] = round(r["end_accuracy"] - r["start_accuracy"], 3)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
