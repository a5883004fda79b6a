"""Operations: service heartbeats and the trainer's step summaries (for `fulmen top`)."""

from __future__ import annotations

from dataclasses import dataclass

from fulmen.codec import (
    pack_record,
    unpack_record,
)


@dataclass(frozen=True, slots=True)
class ServiceBeat:
    """A long-running service process as it last reported itself (every few seconds)."""

    service: str  # runner, adapter, trainer, algorithm, evaluator, watchdog, ...
    instance: str  # unique per process: "<service>-<host>-<pid>"
    host: str
    pid: int
    port: int | None  # where its /healthz, /readyz, /metrics answer (None: not served)
    started: float
    time: float

    def to_wire(self) -> bytes:
        return pack_record("service", {name: getattr(self, name) for name in self.__slots__})

    @classmethod
    def from_wire(cls, data: bytes | None) -> ServiceBeat:
        d = unpack_record(data, "service", required=cls.__slots__)
        return cls(*(d[n] for n in cls.__slots__))


@dataclass(frozen=True, slots=True)
class TrainStep:
    """One optimizer step as the trainer's leader summarises it: the reward curve's points."""

    step: int
    model_version: str
    reward_mean: float | None
    loss: float | None
    samples: int | None
    time: float

    def to_wire(self) -> bytes:
        return pack_record("train_step", {name: getattr(self, name) for name in self.__slots__})

    @classmethod
    def from_wire(cls, data: bytes | None) -> TrainStep:
        d = unpack_record(data, "train_step", required=cls.__slots__)
        return cls(*(d[n] for n in cls.__slots__))
