"""Agents that misbehave in every way an agent can, for the runner's fault tests (test_agent_faults.py)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import fulmen

# Set by the test to let the hung sync agents return, so no thread outlives the test session.
RELEASE = threading.Event()
THREAD_NAMES: list[str] = []


def _raise(kind: str) -> None:
    errors: dict[str, BaseException] = {
        "KeyboardInterrupt": KeyboardInterrupt(),
        "SystemExit": SystemExit(3),
        "GeneratorExit": GeneratorExit(),
        "CancelledError": asyncio.CancelledError(),
        "BaseException": BaseException("odd"),
    }
    raise errors[kind]


@fulmen.rollout
async def raises_base(task: Any) -> float:
    """Raises the BaseException subclass named by task["raise"]."""
    _raise(task["raise"])
    return 1.0


@fulmen.rollout
def sync_raises_base(task: Any) -> float:
    """The same from a sync agent, in its thread."""
    _raise(task["raise"])
    return 1.0


@fulmen.rollout
async def huge_reward(task: Any) -> Any:
    """Returns an integer no float can hold (or a dict holding one)."""
    return {"score": 10**400} if task.get("named") else 10**400


@fulmen.rollout
def sync_hangs(task: Any) -> float:
    """A sync agent that ignores its timeout: it returns only when the test sets RELEASE."""
    THREAD_NAMES.append(threading.current_thread().name)
    RELEASE.wait()
    return 1.0
