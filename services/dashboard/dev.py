"""The dashboard as a task of `fulmen dev` (see `fulmen.cli.dev`)."""

from __future__ import annotations

import asyncio

from fulmen.settings import DashboardSettings, load_settings
from fulmen_dashboard.server import serve_until


async def main(stop: asyncio.Event) -> None:
    await serve_until(load_settings(DashboardSettings), stop)
