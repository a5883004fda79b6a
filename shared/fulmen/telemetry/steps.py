"""The trainer's steps stream in Redis: one record per optimizer step (its metrics), the one record of
progress.

Readers: `latest_step`, `read_steps`, `read_curve`; untrained groups: `record_untrained_groups`,
`UntrainedGroups`. Why: docs/design/trainer.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis

from fulmen.errors import RecordError
from fulmen.keys import Keys
from fulmen.records import TrainStep

MAX_STEPS = 10_000
TAIL_STEPS = 60  # what `fulmen top` draws
CURVE_PAGE = 1000  # entries per XRANGE page when reading the whole curve


async def record_untrained_groups(client: aioredis.Redis, keys: Keys, group_keys: Sequence[str], *,
                                  filtered: bool = False) -> None:
    """Say that these groups were taken without training on them (see the module docstring);
    ``filtered``: left out by the recipe's dynamic sampling (their rewards all equal), not lost."""
    if group_keys:
        await client.sadd(keys.trainer_filtered if filtered else keys.trainer_untrained, *group_keys)


class UntrainedGroups:
    """The number of untrained groups whose key starts with ``prefix`` (one run's), read again only
    when the set's size changes; ``filtered``: those dynamic sampling left out instead."""

    def __init__(self, client: aioredis.Redis, keys: Keys, prefix: str, *, filtered: bool = False) -> None:
        self.client, self.prefix = client, prefix
        self.key = keys.trainer_filtered if filtered else keys.trainer_untrained
        self._size = 0
        self._count = 0

    async def count(self) -> int:
        size = int(await self.client.scard(self.key))
        if size != self._size:
            members = await self.client.smembers(self.key)
            self._count = sum(1 for m in members if (m.decode() if isinstance(m, bytes) else m).startswith(self.prefix))
            self._size = size
        return self._count


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def summarize(step: int, metrics: Mapping[str, Any], time: float) -> TrainStep:
    """A step's record from the trainer's metrics dict: the curve's fields, and every numeric metric
    under a namespace (``rollout/``, ``loss/``, ``perf/``, ``comm/``)."""
    samples = metrics.get("perf/samples")
    numbers = {key: _number(value) for key, value in metrics.items() if "/" in key}
    numeric = {key: value for key, value in numbers.items() if value is not None}
    return TrainStep(
        step, str(metrics.get("model_version", "")), _number(metrics.get("rollout/reward_mean")),
        _number(metrics.get("loss/total")), int(samples) if isinstance(samples, int | float) else None, time,
        numeric,
    )


async def append_step(client: aioredis.Redis, keys: Keys, summary: TrainStep) -> None:
    await client.xadd(keys.trainer_steps, {"m": summary.to_wire()}, maxlen=MAX_STEPS, approximate=True)


def decode_steps(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[TrainStep]:
    """Step records from stream entries, in their order; unreadable entries are left out."""
    steps = []
    for _, fields in entries:
        try:
            steps.append(TrainStep.from_wire(fields.get(b"m")))
        except RecordError:
            continue  # one unreadable entry must not hide the rest
    return steps


def read_steps(client: redis.Redis, keys: Keys, count: int = TAIL_STEPS) -> list[TrainStep]:
    """The last ``count`` entries, oldest first; unreadable entries are left out."""
    return decode_steps(list(reversed(client.xrevrange(keys.trainer_steps, count=count))))


async def latest_step(client: aioredis.Redis, keys: Keys) -> int:
    """The trainer's progress: the step of its last summary (0 before its first step)."""
    last = await latest_summary(client, keys)
    return last.step if last is not None else 0


async def latest_summary(client: aioredis.Redis, keys: Keys) -> TrainStep | None:
    """The trainer's last step summary (its step and the model version it holds), None before any."""
    last = decode_steps(await client.xrevrange(keys.trainer_steps, count=1))
    return last[0] if last else None


async def read_curve(client: aioredis.Redis, keys: Keys) -> list[TrainStep]:
    """Every step still in the stream, one summary per step (the latest), in step order."""
    by_step: dict[int, TrainStep] = {}
    start = "-"
    while entries := await client.xrange(keys.trainer_steps, min=start, count=CURVE_PAGE):
        for summary in decode_steps(entries):
            by_step[summary.step] = summary
        start = "(" + entries[-1][0].decode()
    return [by_step[step] for step in sorted(by_step)]
