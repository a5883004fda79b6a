"""`fulmen dashboard`. Kept light at import: `fulmen --help` loads this module."""

from __future__ import annotations

import typer

from fulmen.cli.service import settings_command
from fulmen.settings import DashboardSettings

NAMES = {"dashboard_host": ("--host", "--dashboard-host"), "dashboard_port": ("--port", "--dashboard-port")}


@settings_command(DashboardSettings, names=NAMES)
def command(settings: DashboardSettings) -> None:
    """Serve the web dashboard: experiments and runs, rollouts with filters, each rollout's attempts
    and span tree (every LLM call with its messages, response, tokens and log-probabilities), the
    live pipeline and the curves, updating as the run goes on.

    Read-only by default; FULMEN_DASHBOARD_ADMIN=true allows cancelling rollouts and requeuing dead
    letters. FULMEN_DASHBOARD_TOKEN (environment only) requires a bearer token or basic auth."""
    from fulmen_dashboard.server import serve

    try:
        serve(settings)
    except OSError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
