"""Chaos: SIGKILL each service mid-run, start it again with the same command, check the store.

    python bench/chaos.py                      # every service, the embedded Redis included
    python bench/chaos.py --services runner trainer

For each service, a short training run (tiny model, 4 trainer versions, GRPO groups of 4, a
validation pass every 2 versions) starts with every service as its own process and its own embedded
Redis (`fulmen redis`, AOF on); the service is SIGKILLed at the moment that hurts it most (the
runner holding attempts, the trainer holding unacknowledged samples, the evaluator inside its job,
…), started again, and the run must finish with nothing lost and nothing counted twice — see
tests/chaos_harness.py for what is checked. Prints one line per service and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness the CI test uses

from chaos_harness import SERVICES, ChaosConfig, Verdict, chaos_case


async def main(services: list[str], keep: bool) -> dict[str, object]:
    config = ChaosConfig(val_tasks=4, val_every=2)
    verdicts: list[Verdict] = []
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="fulmen-chaos-"))
    try:
        for service in services:
            verdict = await chaos_case(service, tmp / service, f"chaos-{uuid.uuid4().hex[:8]}", config, redis_url=None)
            verdicts.append(verdict)
            print(verdict.line(), flush=True)
    finally:
        if keep:
            print(f"logs kept in {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "services_ok": sum(v.ok for v in verdicts),
        "services_total": len(verdicts),
        "failed": [v.service for v in verdicts if not v.ok],
        "lost": sum(v.lost for v in verdicts),
        "duplicated": sum(v.duplicated for v in verdicts),
        "not_terminal": sum(v.not_terminal for v in verdicts),
        "trained_twice": sum(v.trained_twice for v in verdicts),
        "rollouts": sum(v.rollouts for v in verdicts),
        "retried": sum(v.retried for v in verdicts),
        "unexpected_exits": {v.service: v.unexpected_exits for v in verdicts if v.unexpected_exits},
        "wall_s": round(time.monotonic() - started, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", nargs="+", choices=SERVICES, default=list(SERVICES))
    parser.add_argument("--keep", action="store_true", help="keep every service's logs and print where")
    args = parser.parse_args()
    result = asyncio.run(main(args.services, args.keep))
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["services_ok"] == result["services_total"] else 1)
