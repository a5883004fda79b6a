"""Operations: service heartbeats and the trainer's step records (the steps stream)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from fulmen.records.base import Record


@dataclass(frozen=True, slots=True)
class ServiceBeat(Record):
    """A long-running service process as it last reported itself (every few seconds)."""

    KIND: ClassVar[str] = "service"

    service: str  # runner, adapter, trainer, algorithm, evaluator, watchdog, ...
    instance: str  # unique per process: "<service>-<host>-<pid>"
    host: str
    pid: int
    port: int | None  # where its /healthz, /readyz, /metrics answer (None: not served)
    started: float
    time: float


@dataclass(frozen=True, slots=True)
class TrainStep(Record):
    """One optimizer step as the trainer's leader records it: the reward curve's points, and every
    numeric metric of the step (``metrics``: ``loss/``, ``rollout/``, ``perf/``, ``comm/`` keys)."""

    KIND: ClassVar[str] = "train_step"

    step: int
    model_version: str
    reward_mean: float | None
    loss: float | None
    samples: int | None
    time: float
    metrics: dict[str, float] = field(default_factory=dict)
