"""The proxy's background tasks (registry heartbeat, control reader, model follower) are started again
after a failure, and the proxy says it is not ready meanwhile (issue 20, item 1)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from fulmen_llm_proxy import service
from fulmen_llm_proxy.service import ProxyService


async def test_a_failed_background_task_is_started_again_and_the_proxy_is_unready_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The follower dies on an error twice; it runs a third time, and `_down` names it only while down."""
    monkeypatch.setattr(service, "RESTART_FIRST_DELAY_S", 0.05)
    proxy = SimpleNamespace(_down=set())
    runs: list[int] = []
    seen_down: list[set[str]] = []

    async def follower() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise ConnectionError("Redis went away")

    async def watch() -> None:
        while len(runs) < 3:
            seen_down.append(set(proxy._down))
            await asyncio.sleep(0.01)

    await asyncio.wait_for(asyncio.gather(ProxyService._supervise(proxy, follower, "model versions"), watch()), 5)
    assert runs == [0, 1, 2]
    assert {"model versions"} in seen_down
    assert proxy._down == set()
