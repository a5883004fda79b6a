"""`fulmen.dev`: .env read as honcho reads it, and the run's end (or a failure) stopping every service."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from fulmen import dev


def test_dotenv_fills_in_what_the_environment_does_not_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Comments and blank lines are skipped, quotes dropped; a variable already set wins."""
    (tmp_path / ".env").write_text("# the demo\n\nDEV_TEST_A=1\nDEV_TEST_B='two'\nDEV_TEST_C=from-file\n")
    monkeypatch.setenv("DEV_TEST_C", "from-shell")
    for name in ("DEV_TEST_A", "DEV_TEST_B"):
        monkeypatch.delenv(name, raising=False)
    dev.apply_dotenv(tmp_path / ".env")
    assert (os.environ["DEV_TEST_A"], os.environ["DEV_TEST_B"], os.environ["DEV_TEST_C"]) == ("1", "two", "from-shell")


async def test_the_runs_end_stops_every_service() -> None:
    """When the algorithm returns, every other service sees stop and ends; exit code 0."""
    stopped: list[str] = []

    async def service(stop: asyncio.Event) -> None:
        await stop.wait()
        stopped.append("service")

    async def algorithm(stop: asyncio.Event) -> None:
        await asyncio.sleep(0)

    assert await dev.run_all({"runner": service, "adapter": service, "algorithm": algorithm}) == 0
    assert stopped == ["service", "service"]


async def test_a_failing_service_stops_the_others_with_code_1() -> None:
    """A service that raises ends the run: the others are stopped, the exit code is 1."""
    stopped: list[str] = []

    async def service(stop: asyncio.Event) -> None:
        await stop.wait()
        stopped.append("service")

    async def broken(stop: asyncio.Event) -> None:
        raise RuntimeError("boom")

    assert await dev.run_all({"runner": service, "trainer": broken, "algorithm": service}) == 1
    assert stopped == ["service", "service"]
