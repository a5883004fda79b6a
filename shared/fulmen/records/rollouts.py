"""Rollouts and their attempts: Redis hashes whose plain fields the Lua scripts read and write;
their free-form parts (input, metadata, error) are msgpack inside a field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fulmen.codec import (
    DEFAULT_MAX_RECORD_BYTES,
    check_version,
    pack,
    unpack,
)
from fulmen.errors import InvalidInput
from fulmen.records.status import RETRYABLE_ATTEMPT, AttemptStatus, Priority, RolloutMode, RolloutStatus


def _s(raw: Mapping[bytes, bytes], name: str) -> str:
    return raw.get(name.encode(), b"").decode()


def _f(raw: Mapping[bytes, bytes], name: str) -> float | None:
    value = raw.get(name.encode(), b"")
    return float(value) if value else None


def _i(raw: Mapping[bytes, bytes], name: str) -> int:
    value = raw.get(name.encode(), b"")
    return int(value) if value else 0


def _blob(raw: Mapping[bytes, bytes], name: str, default: Any) -> Any:
    value = raw.get(name.encode(), b"")
    return unpack(value) if value else default


def _opt(value: float | None) -> str | float:
    return "" if value is None else value


def _positive_or_none(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise InvalidInput(f"{name} must be a positive number of seconds or None, got {value!r}")
    return value


# --- rollouts and attempts --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """Retry and timeout policy of one rollout (Agent Lightning's RolloutConfig)."""

    timeout_seconds: float | None = None  # an attempt running longer than this becomes "timeout"
    unresponsive_seconds: float | None = None  # no heartbeat for this long: "unresponsive"
    max_attempts: int = 1  # attempts in all, the first one included
    retry_condition: tuple[str, ...] = ()  # attempt outcomes that trigger a retry

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "timeout_seconds", _positive_or_none("timeout_seconds", self.timeout_seconds)
        )
        object.__setattr__(
            self, "unresponsive_seconds", _positive_or_none("unresponsive_seconds", self.unresponsive_seconds)
        )
        if (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or self.max_attempts < 1
        ):
            raise InvalidInput(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        conditions = tuple(dict.fromkeys(str(c) for c in self.retry_condition))
        unknown = set(conditions) - set(RETRYABLE_ATTEMPT)
        if unknown:
            allowed = ", ".join(sorted(RETRYABLE_ATTEMPT))
            raise InvalidInput(f"retry_condition {sorted(unknown)} unknown; allowed: {allowed}")
        object.__setattr__(self, "retry_condition", conditions)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> RolloutConfig:
        allowed = {"timeout_seconds", "unresponsive_seconds", "max_attempts", "retry_condition"}
        unknown = set(value) - allowed
        if unknown:
            raise InvalidInput(f"unknown rollout config keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        data = dict(value)
        if "retry_condition" in data:
            data["retry_condition"] = tuple(data["retry_condition"] or ())
        return cls(**data)


@dataclass(frozen=True, slots=True)
class Rollout:
    rollout_id: str
    input: Any
    status: RolloutStatus = RolloutStatus.QUEUING
    mode: RolloutMode | None = None
    resources_id: str | None = None
    config: RolloutConfig = field(default_factory=RolloutConfig)
    metadata: dict[str, Any] = field(default_factory=dict)
    enqueue_time: float | None = None
    start_time: float | None = None  # first attempt's start
    end_time: float | None = None  # when it reached a terminal status
    attempt_count: int = 0  # sequence number of the latest attempt
    attempt_id: str | None = None  # the latest attempt, which drives the status
    reward: float | None = None  # the final reward of the attempt that ended it, as its runner reported
    priority: Priority = Priority.NORMAL  # its queue lane, kept when it is queued again

    def to_hash(self, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> dict[str, Any]:
        c = self.config
        return {
            "v": 1,
            "rollout_id": self.rollout_id,
            "status": self.status.value,
            "mode": self.mode.value if self.mode else "",
            "resources_id": self.resources_id or "",
            "input": pack(self.input, max_bytes),
            "metadata": pack(self.metadata, max_bytes),
            "max_attempts": c.max_attempts,
            "retry_on": ",".join(c.retry_condition),
            "timeout_s": _opt(c.timeout_seconds),
            "unresponsive_s": _opt(c.unresponsive_seconds),
            "enqueue_time": _opt(self.enqueue_time),
            "start_time": _opt(self.start_time),
            "end_time": _opt(self.end_time),
            "attempt_n": self.attempt_count,
            "attempt_id": self.attempt_id or "",
            "reward": _opt(self.reward),
            "priority": self.priority.value,
        }

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes]) -> Rollout:
        check_version(_i(raw, "v"), "rollout")
        mode = _s(raw, "mode")
        retry_on = _s(raw, "retry_on")
        return cls(
            rollout_id=_s(raw, "rollout_id"),
            input=_blob(raw, "input", None),
            status=RolloutStatus(_s(raw, "status")),
            mode=RolloutMode(mode) if mode else None,
            resources_id=_s(raw, "resources_id") or None,
            config=RolloutConfig(
                timeout_seconds=_f(raw, "timeout_s"),
                unresponsive_seconds=_f(raw, "unresponsive_s"),
                max_attempts=_i(raw, "max_attempts") or 1,
                retry_condition=tuple(retry_on.split(",")) if retry_on else (),
            ),
            metadata=_blob(raw, "metadata", {}),
            enqueue_time=_f(raw, "enqueue_time"),
            start_time=_f(raw, "start_time"),
            end_time=_f(raw, "end_time"),
            attempt_count=_i(raw, "attempt_n"),
            attempt_id=_s(raw, "attempt_id") or None,
            reward=_f(raw, "reward"),
            priority=Priority(_s(raw, "priority") or Priority.NORMAL),  # stored before lanes: normal
        )


@dataclass(frozen=True, slots=True)
class Attempt:
    rollout_id: str
    attempt_id: str
    sequence_id: int  # 1 for the first attempt of the rollout
    status: AttemptStatus
    worker_id: str | None = None
    start_time: float | None = None
    end_time: float | None = None
    last_heartbeat_time: float | None = None
    error: dict[str, Any] | None = None  # {"type", "message", "traceback"} of a failure
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None  # the final reward its runner computed (None: none, or not ended)

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes]) -> Attempt:
        check_version(_i(raw, "v"), "attempt")
        return cls(
            rollout_id=_s(raw, "rollout_id"),
            attempt_id=_s(raw, "attempt_id"),
            sequence_id=_i(raw, "sequence_id"),
            status=AttemptStatus(_s(raw, "status")),
            worker_id=_s(raw, "worker_id") or None,
            start_time=_f(raw, "start_time"),
            end_time=_f(raw, "end_time"),
            last_heartbeat_time=_f(raw, "heartbeat_time"),
            error=_blob(raw, "error", None),
            metadata=_blob(raw, "metadata", {}),
            reward=_f(raw, "reward"),
        )


@dataclass(frozen=True, slots=True)
class AttemptedRollout:
    """What a runner gets from a claim: the rollout and the attempt it now owns."""

    rollout: Rollout
    attempt: Attempt
