"""Serve the dashboard under uvicorn, on a socket bound here (so port 0 works and the log names the
port actually bound), inside a running event loop until told to stop (`serve_until`)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket

import uvicorn

from fulmen.settings import DashboardSettings
from fulmen_dashboard.app import DashboardApp

log = logging.getLogger("fulmen.dashboard")

DEFAULT_PORT = 8300
GRACEFUL_SHUTDOWN_S = 3  # honcho sends SIGKILL after 5 s


def port_of(settings: DashboardSettings) -> int:
    if settings.dashboard_port is not None:
        return settings.dashboard_port
    port = os.environ.get("PORT", "").strip()
    return int(port) if port.isdigit() else DEFAULT_PORT


def listen(settings: DashboardSettings) -> socket.socket:
    """The dashboard's listening socket. A port the user chose (FULMEN_DASHBOARD_PORT, --port) must be
    free. The one honcho hands out ($PORT) or the default is a wish: if another process holds it, any
    free port instead, with a warning (the log line after names the URL). Under honcho one process
    that exits stops them all, and a run is not worth stopping for its dashboard's port."""
    port = port_of(settings)
    try:
        return bind(settings.dashboard_host, port)
    except OSError as e:
        if settings.dashboard_port is None and e.errno == errno.EADDRINUSE:
            log.warning("port %d is in use by another process: the dashboard takes a free port instead", port)
            return bind(settings.dashboard_host, 0)
        raise OSError(e.errno, f"the dashboard cannot listen on {settings.dashboard_host}:{port} ({e.strerror}): "
                               "set FULMEN_DASHBOARD_PORT (or --port) to a free port, or 0 for any") from None


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def server(settings: DashboardSettings, sock: socket.socket) -> uvicorn.Server:
    config = uvicorn.Config(
        DashboardApp(settings), lifespan="on", access_log=False, proxy_headers=False,
        log_level=settings.log_level.lower(), timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return uvicorn.Server(config)


def _announce(settings: DashboardSettings, sock: socket.socket) -> None:
    host, port = sock.getsockname()[:2]
    log.info("dashboard on http://%s:%d/ (%s, %s)", host, port,
             "admin actions on" if settings.dashboard_admin else "read-only",
             "auth required" if settings.dashboard_token is not None else "no auth")


async def serve_until(settings: DashboardSettings, stop: asyncio.Event) -> None:
    """Serve in the running loop until ``stop`` is set (whoever sets it owns the signals)."""
    from fulmen.cli.service import serve_http

    sock = listen(settings)
    _announce(settings, sock)
    await serve_http(server(settings, sock), sock, stop)
