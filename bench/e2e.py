"""Wall-clock from `honcho start` to the demo's accuracy target: asynchronous (staleness 1) against
synchronous (staleness 0) training, and the same run with GRPO switched off (learning rate 0: the
warm start, served and validated the same way for the same time).

Each variant is the README's demo — the repository's Procfile and .env, every service a process —
in a fresh folder on free ports. Validation passes (300 held-out questions, greedy) are read from
the store as they land; a variant ends at the first pass at or above --target, or at --budget-s.

    python bench/e2e.py                              # async, sync, grpo_off: up to 3 x 15 min
    python bench/e2e.py --variants async --budget-s 900
    python bench/e2e.py --variants run_file          # the same, by `fulmen start examples/runs/demo.yaml`

Prints one JSON line per variant, then one JSON object with every figure; draws the curves into
--plot (bench/e2e-curves.png)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import honcho_demo as run

VARIANTS: dict[str, dict[str, str]] = {
    "async": {"FULMEN_STALENESS": "1"},
    "sync": {"FULMEN_STALENESS": "0"},
    "grpo_off": {"FULMEN_STALENESS": "1", "FULMEN_LEARNING_RATE": "0", "FULMEN_LR_FINAL": "0"},
    # async again, started as `fulmen start examples/runs/demo.yaml` (the run file instead of .env;
    # the ports and the step count come from the environment, which wins over the file)
    "run_file": {},
}
RUN_FILE = "examples/runs/demo.yaml"


def _reached(passes: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    return next((v for v in passes if v["label"] != "v0" and v["accuracy"] >= target), None)


def _start(name: str, folder: Path) -> tuple[int, dict[str, str], list[str] | None]:
    """The variant's folder, environment and command: `honcho start` on .env, or `fulmen start` on the
    run file with only the ports and the step count in the environment."""
    overrides = {"FULMEN_TOTAL_STEPS": "100000", **VARIANTS[name]}
    if name != "run_file":
        return run.write_folder(folder, "Procfile", ".env", overrides), run.clean_env(), None
    shutil.copy(run.ROOT / RUN_FILE, folder / "demo.yaml")
    shutil.copy(run.ROOT / "Procfile", folder / "Procfile")
    redis_port = run.free_port()
    env = {**run.clean_env(), **overrides, "FULMEN_REDIS_PORT": str(redis_port),
           "FULMEN_PROXY_PORT": str(run.free_port()), "FULMEN_METRICS_PORT": "0"}
    return redis_port, env, [str(Path(sys.executable).with_name("fulmen")), "start", "demo.yaml"]


def run_variant(name: str, target: float, budget_s: float, folder: Path) -> dict[str, Any]:
    redis_port, env, argv = _start(name, folder)
    started = time.time()
    with run.honcho_start(folder, env, argv) as honcho:
        passes = run.watch_validations(honcho, redis_port, name, started, budget_s,
                                   lambda passes: _reached(passes, target) is not None)
    reached = _reached(passes, target)
    points = run.curve(passes, started)
    warm = next((c["accuracy"] for c in points if c["label"] == "v0"), None)
    return {
        "variant": name, "target": target, "budget_s": budget_s,
        "time_to_target_s": round(reached["time"] - started, 1) if reached else None,
        "steps_to_target": reached.get("step") if reached else None,
        "warm_start_accuracy": warm,
        "best_accuracy": max((c["accuracy"] for c in points if c["label"] != "v0"), default=None),
        "last_accuracy": points[-1]["accuracy"] if points else None,
        "wall_s": round(time.time() - started, 1), "curve": points,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="async,sync,grpo_off", help="Comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--target", type=float, default=0.9, help="Validation accuracy to reach.")
    parser.add_argument("--budget-s", type=float, default=900.0, help="Most seconds per variant (15 min).")
    parser.add_argument("--plot", type=Path, default=run.ROOT / "bench" / "e2e-curves.png")
    args = parser.parse_args()
    names = run.variant_names(parser, args.variants, VARIANTS)
    results = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"fulmen-e2e-{name}-") as folder:
            print(f"{name}: honcho start in {folder} (budget {args.budget_s:.0f} s)", file=sys.stderr, flush=True)
            result = run_variant(name, args.target, args.budget_s, Path(folder))
        print(json.dumps(result), flush=True)
        results.append(result)
    run.plot(results, args.plot, "validation accuracy (300, greedy)", args.target)
    figures: dict[str, Any] = {"target": args.target, "budget_s": args.budget_s, "plot": str(args.plot)}
    for r in results:
        for field in ("time_to_target_s", "steps_to_target", "warm_start_accuracy", "best_accuracy", "last_accuracy"):
            figures[f"{r['variant']}_{field}"] = r[field]
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
