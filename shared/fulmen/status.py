"""Rollout and attempt statuses (Agent Lightning 0.3 vocabulary) and which of them end things."""

from __future__ import annotations

from enum import StrEnum


class RolloutStatus(StrEnum):
    QUEUING = "queuing"
    PREPARING = "preparing"
    RUNNING = "running"
    REQUEUING = "requeuing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class AttemptStatus(StrEnum):
    PREPARING = "preparing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"
    UNRESPONSIVE = "unresponsive"


class RolloutMode(StrEnum):
    TRAIN = "train"
    VAL = "val"
    TEST = "test"


TERMINAL_ROLLOUT = frozenset({RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED})
WAITING_ROLLOUT = frozenset({RolloutStatus.QUEUING, RolloutStatus.REQUEUING})
ACTIVE_ATTEMPT = frozenset({AttemptStatus.PREPARING, AttemptStatus.RUNNING})
# Attempt outcomes a rollout's retry_condition may name.
RETRYABLE_ATTEMPT = frozenset({AttemptStatus.FAILED, AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE})
