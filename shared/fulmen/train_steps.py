"""The trainer's step log in Redis: a capped stream of per-step summaries (the reward curve).

The trainer's leader appends one `TrainStep` per optimizer step; `fulmen top` reads the tail to draw
the reward sparkline from any machine (the JSON-lines metrics file stays on the trainer's disk).
Capped (approximately, which lets Redis trim whole nodes cheaply) so a long run cannot grow it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio as aioredis

from fulmen.errors import RecordError
from fulmen.keys import Keys
from fulmen.records import TrainStep

MAX_STEPS = 10_000


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def summarize(step: int, metrics: Mapping[str, Any], time: float) -> TrainStep:
    """A step's summary from the trainer's metrics dict (its ``rollout/``, ``loss/``, ``perf/`` keys)."""
    samples = metrics.get("perf/samples")
    return TrainStep(
        step, str(metrics.get("model_version", "")), _number(metrics.get("rollout/reward_mean")),
        _number(metrics.get("loss/total")), int(samples) if isinstance(samples, int | float) else None, time,
    )


async def append_step(client: aioredis.Redis, keys: Keys, summary: TrainStep) -> None:
    await client.xadd(keys.trainer_steps, {"m": summary.to_wire()}, maxlen=MAX_STEPS, approximate=True)


def read_steps(client: redis.Redis, keys: Keys, count: int = 60) -> list[TrainStep]:
    """The last ``count`` steps, oldest first; unreadable entries are left out."""
    steps = []
    for _, fields in reversed(client.xrevrange(keys.trainer_steps, count=count)):
        try:
            steps.append(TrainStep.from_wire(fields.get(b"m")))
        except RecordError:
            continue
    return steps
