"""Rollout and attempt statuses (Agent Lightning 0.3 vocabulary) and the one table of their transitions.

Every status set (here and in the Lua of `fulmen.store.lua.scripts`) is derived from the transition
tables: a new status or transition is written once, here. The diagram: docs/design/records.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

from fulmen.errors import InvalidInput


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


class Priority(StrEnum):
    """A rollout's priority lane (`fulmen.keys.LANES`, highest first; the claim rule is
    `fulmen.store.queue`'s). Validation rollouts are urgent unless told otherwise, the rest normal."""

    URGENT = "urgent"
    NORMAL = "normal"
    LOW = "low"

    @classmethod
    def parse(cls, value: object) -> Priority:
        """A priority from its name; anything else is `InvalidInput` naming the lanes."""
        try:
            return cls(value)
        except ValueError:
            lanes = ", ".join(p.value for p in cls)
            raise InvalidInput(f"priority {value!r} unknown; use {lanes}") from None


R, A = RolloutStatus, AttemptStatus

# Where each status may go next; a status with nowhere to go is terminal. A manual attempt
# (`start_attempt`) may begin from any non-terminal status, and `update_rollout` may force any
# non-terminal rollout to an end or back to the queue.
ROLLOUT_TRANSITIONS: Mapping[RolloutStatus, frozenset[RolloutStatus]] = {
    R.QUEUING: frozenset({R.PREPARING, R.SUCCEEDED, R.FAILED, R.CANCELLED}),
    R.REQUEUING: frozenset({R.PREPARING, R.SUCCEEDED, R.FAILED, R.CANCELLED}),
    R.PREPARING: frozenset({R.PREPARING, R.RUNNING, R.REQUEUING, R.SUCCEEDED, R.FAILED, R.CANCELLED}),
    R.RUNNING: frozenset({R.PREPARING, R.REQUEUING, R.SUCCEEDED, R.FAILED, R.CANCELLED}),
    R.SUCCEEDED: frozenset(),
    R.FAILED: frozenset(),
    R.CANCELLED: frozenset(),
}
ATTEMPT_TRANSITIONS: Mapping[AttemptStatus, frozenset[AttemptStatus]] = {
    A.PREPARING: frozenset({A.RUNNING, A.SUCCEEDED, A.FAILED, A.TIMEOUT, A.UNRESPONSIVE}),
    A.RUNNING: frozenset({A.SUCCEEDED, A.FAILED, A.TIMEOUT, A.UNRESPONSIVE}),
    A.SUCCEEDED: frozenset(),
    A.FAILED: frozenset(),
    A.TIMEOUT: frozenset(),
    A.UNRESPONSIVE: frozenset(),
}

TERMINAL_ROLLOUT = frozenset(s for s, after in ROLLOUT_TRANSITIONS.items() if not after)
ACTIVE_ATTEMPT = frozenset(s for s, after in ATTEMPT_TRANSITIONS.items() if after)
# A rollout that has not ended and whose status is not its attempt's (preparing, running) waits
# on the queue.
WAITING_ROLLOUT = frozenset(
    s for s in ROLLOUT_TRANSITIONS if s not in TERMINAL_ROLLOUT and s.value not in set(ACTIVE_ATTEMPT)
)
# Attempt outcomes a rollout's retry_condition may name: every end but success.
RETRYABLE_ATTEMPT = frozenset(
    s for s, after in ATTEMPT_TRANSITIONS.items() if not after and s is not AttemptStatus.SUCCEEDED
)


def lua_set(name: str, statuses: Iterable[StrEnum]) -> str:
    """A Lua table literal used as a set: ``local NAME = {a = true, b = true}``."""
    members = ", ".join(f"{s.value} = true" for s in sorted(statuses))
    return f"local {name} = {{{members}}}"
