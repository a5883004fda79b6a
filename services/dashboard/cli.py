"""`fulmen dashboard`. Kept light at import: `fulmen --help` loads this module."""

from __future__ import annotations

from fulmen.cli.service import run_service, service_command
from fulmen.settings import DashboardSettings
from fulmen_dashboard.main import SERVICE

NAMES = {"dashboard_host": ("--host", "--dashboard-host"), "dashboard_port": ("--port", "--dashboard-port")}


@service_command(SERVICE, names=NAMES)
def command(settings: DashboardSettings) -> None:
    """Serve the web dashboard: experiments and runs, rollouts with filters, each rollout's attempts
    and span tree (every LLM call with its messages, response, tokens and log-probabilities), the
    live pipeline and the curves, updating as the run goes on.

    Read-only by default; FULMEN_DASHBOARD_ADMIN=true allows cancelling rollouts and requeuing dead
    letters. FULMEN_DASHBOARD_TOKEN (environment only) requires a bearer token or basic auth."""
    run_service(SERVICE, settings)
