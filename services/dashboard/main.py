"""The dashboard as a `Service`: `run(settings, stop)`, which `fulmen dashboard` and `fulmen dev` both
call. Kept light at import (`fulmen --help` loads it); the server: `fulmen_dashboard.server`."""

from __future__ import annotations

import asyncio

from fulmen.cli.service import Service
from fulmen.errors import FulmenError
from fulmen.settings import DashboardSettings


async def run(settings: DashboardSettings, stop: asyncio.Event) -> None:
    """Serve the dashboard until ``stop`` is set; a port it cannot listen on raises FulmenError."""
    from fulmen_dashboard.server import serve_until

    try:
        await serve_until(settings, stop)
    except OSError as e:
        raise FulmenError(str(e)) from None


SERVICE = Service("dashboard", DashboardSettings, run)
