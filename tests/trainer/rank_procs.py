"""What the tests of trainer ranks as processes share (test_ranks.py, test_torchrun.py): samples pushed
for the trainers, a trainer process's environment, two ranks started until both are ready, and the
metrics file read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from polling import until

from fulmen import keys as k
from fulmen.records import Sample
from fulmen.store import RedisStore

FULMEN = str(Path(sys.executable).with_name("fulmen"))


async def push(store: RedisStore, samples: list[Sample]) -> None:
    await store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    for s in samples:
        await store.redis.xadd(store.keys.samples, {"m": s.to_wire()})


def trainer_env(redis_url: str, experiment: str, tiny: Path, out: Path, **extra: str) -> dict[str, str]:
    """A trainer of ``experiment`` on ``tiny``, 2 groups a step, its checkpoints and metrics in ``out``."""
    return {**os.environ, "REDIS_URL": redis_url, "FULMEN_EXPERIMENT": experiment, "FULMEN_MODEL_DIR": str(tiny),
            "FULMEN_GROUPS_PER_STEP": "2", "FULMEN_CHECKPOINT_DIR": str(out / "ck"),
            "FULMEN_METRICS_FILE": str(out / "metrics.jsonl"), "FULMEN_TORCH_THREADS": "1",
            "FULMEN_LEARNING_RATE": "0.001", **extra}


async def ready(store: RedisStore, rank: int) -> bool:
    return (await store.redis.get(store.keys.trainer_slot(rank)) or b"").endswith(b":ready")


async def start_two_ranks(store: RedisStore, env: dict[str, str], procs: list[subprocess.Popen[Any]],
                          *leader_args: str) -> tuple[subprocess.Popen[Any], subprocess.Popen[Any]]:
    """`fulmen trainer` as rank 0 (with ``leader_args``), then as rank 1 once rank 0 is ready: each
    added to ``procs`` as it starts (for the caller to stop), both ready on return."""
    procs.append(leader := subprocess.Popen([FULMEN, "trainer", *leader_args], env=env))
    await until(lambda: ready(store, 0))
    procs.append(follower := subprocess.Popen([FULMEN, "trainer"], env=env))
    await until(lambda: ready(store, 1))
    return leader, follower


def metrics_lines(path: Path) -> list[dict[str, Any]]:
    """The trainer's metrics file, a dict a step; none before it is written."""
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
