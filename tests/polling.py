"""Waiting in async tests for a condition a service brings about."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


async def until(predicate: Callable[[], Awaitable[Any]], timeout_s: float = 60.0) -> None:
    """Poll ``predicate`` every 50 ms until it is true; AssertionError after ``timeout_s``."""
    for _ in range(int(timeout_s / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")
