"""Chaos: kill services mid-run, start them again, check the store, and time how long the pipeline
takes to resume.

    python bench/chaos.py                          # each service SIGKILLed once, the embedded Redis included
    python bench/chaos.py --services runner trainer
    python bench/chaos.py --random --seeds 1 2 3   # random SIGKILL/SIGTERM of random services, per seed

Each case is a short training run (tiny model, GRPO groups of 4) with every service as its own
process and its own embedded Redis (`fulmen redis`, AOF on).

- Per service (default): the service is SIGKILLed at the moment that hurts it most (the runner
  holding attempts, the trainer holding unacknowledged samples, the evaluator inside its job, …) and
  started again at once.
- ``--random``: for ``--faults-s`` of run time, a random service (Redis included) gets SIGKILL or
  SIGTERM every 1–4 s and comes back after 0.5–3 s (a Redis fault is followed by a proxy fault); the
  seed fixes the sequence.

Either way the run must finish with nothing lost and nothing counted twice (tests/chaos_harness.py
says what is checked), and after each fault the time until the pipeline makes progress again
(a completion, a sample or a trainer step) is measured from the restart. Prints one line per case
and, last, one JSON object: ``resume_s`` per kind of kill (``<service>/<signal>``: count, median,
max) and ``redis_resume_max_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness the CI tests use

from chaos_harness import SERVICES, ChaosConfig, Fault, Verdict, chaos_case, random_fault_case


async def per_service(services: list[str], tmp: Path) -> tuple[list[Verdict], list[Fault]]:
    config = ChaosConfig(val_tasks=4, val_every=2)
    verdicts, faults = [], []
    for service in services:
        verdict = await chaos_case(service, tmp / service, f"chaos-{uuid.uuid4().hex[:8]}", config, redis_url=None)
        verdicts.append(verdict)
        faults.append(Fault(0.0, service, "SIGKILL", 0.0, verdict.resume_s))
        print(verdict.line(), flush=True)
    return verdicts, faults


async def random_seeds(seeds: list[int], faults_s: float, tmp: Path) -> tuple[list[Verdict], list[Fault]]:
    config = ChaosConfig(total_steps=30, train_tasks=80, val_tasks=4, val_every=10)
    verdicts, faults = [], []
    for seed in seeds:
        verdict, made = await random_fault_case(seed, tmp / f"seed-{seed}", f"rf-{uuid.uuid4().hex[:8]}", config,
                                                faults_s=faults_s)
        verdicts.append(verdict)
        faults += made
        print(verdict.line(), flush=True)
        for name, tails in verdict.exit_logs.items():
            for tail in tails:
                print(f"    --- {name} exited on its own; the end of its log:\n{tail}", flush=True)
        for fault in made:
            print(f"    {fault.at_s:6.1f} s  {fault.service:<10} {fault.signal:<8} down {fault.down_s:.1f} s  "
                  f"resumed {'-' if fault.resume_s is None else f'{fault.resume_s:.2f} s'}", flush=True)
    return verdicts, faults


def resume_table(faults: list[Fault]) -> dict[str, dict[str, float | int]]:
    by_kind: dict[str, list[float]] = {}
    for fault in faults:
        if fault.resume_s is not None:  # None: the run ended before the pipeline had anything to do
            by_kind.setdefault(f"{fault.service}/{fault.signal}", []).append(fault.resume_s)
    return {kind: {"n": len(times), "median": round(statistics.median(times), 2), "max": round(max(times), 2)}
            for kind, times in sorted(by_kind.items())}


async def main(args: argparse.Namespace) -> dict[str, object]:
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="fulmen-chaos-"))
    try:
        if args.random:
            verdicts, faults = await random_seeds(args.seeds, args.faults_s, tmp)
        else:
            verdicts, faults = await per_service(args.services, tmp)
    finally:
        if args.keep:
            print(f"logs kept in {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    resume = resume_table(faults)
    redis = [v["max"] for kind, v in resume.items() if kind.startswith("redis/")]
    return {
        "mode": "random" if args.random else "per_service",
        "seeds": args.seeds if args.random else None,
        "cases_ok": sum(v.ok for v in verdicts),
        "cases_total": len(verdicts),
        "failed": [v.service for v in verdicts if not v.ok],
        "faults": len(faults),
        "lost": sum(v.lost for v in verdicts),
        "duplicated": sum(v.duplicated for v in verdicts),
        "not_terminal": sum(v.not_terminal for v in verdicts),
        "trained_twice": sum(v.trained_twice for v in verdicts),
        "succeeded_twice": sum(v.succeeded_twice for v in verdicts),
        "from_retried_calls": sum(v.from_retried_calls for v in verdicts),
        "max_staleness": max((v.max_staleness for v in verdicts), default=0),
        "from_base_after_v1": sum(v.from_base_after_v1 for v in verdicts),
        "failed_by_proxy": sum(v.failed_by_proxy for v in verdicts),
        "rollouts": sum(v.rollouts for v in verdicts),
        "retried": sum(v.retried for v in verdicts),
        "resume_s": resume,
        "redis_resume_max_s": max(redis) if redis else None,
        "unexpected_exits": {v.service: v.unexpected_exits for v in verdicts if v.unexpected_exits},
        "wall_s": round(time.monotonic() - started, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", nargs="+", choices=SERVICES, default=list(SERVICES),
                        help="per-service mode: which services to kill, one case each")
    parser.add_argument("--random", action="store_true", help="random faults instead, one run per seed")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="random mode: the seeds")
    parser.add_argument("--faults-s", type=float, default=60.0, help="random mode: run time with faults")
    parser.add_argument("--keep", action="store_true", help="keep every service's logs and print where")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["cases_ok"] == result["cases_total"] else 1)
