"""Serve the dashboard under uvicorn, on a socket bound here (so port 0 works and the log names the
port actually bound). `serve_until` runs it inside a running event loop (`fulmen dev`)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from types import FrameType

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


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the stop signal once shut down (exit status -15, which honcho reports as a
        # failure); SIGTERM is how a service is stopped, so the process exits 0 after its shutdown
        self._captured_signals.clear()


def server(settings: DashboardSettings, sock: socket.socket) -> uvicorn.Server:
    config = uvicorn.Config(
        DashboardApp(settings), lifespan="on", access_log=False, proxy_headers=False,
        log_level=settings.log_level.lower(), timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return _Server(config)


def _announce(settings: DashboardSettings, sock: socket.socket) -> None:
    host, port = sock.getsockname()[:2]
    log.info("dashboard on http://%s:%d/ (%s, %s)", host, port,
             "admin actions on" if settings.dashboard_admin else "read-only",
             "auth required" if settings.dashboard_token is not None else "no auth")


def serve(settings: DashboardSettings) -> None:
    """Serve until SIGTERM/SIGINT (blocking)."""
    sock = listen(settings)
    _announce(settings, sock)
    the_server = server(settings, sock)
    the_server.run(sockets=[sock])


async def serve_until(settings: DashboardSettings, stop: asyncio.Event) -> None:
    """Serve in the running loop until ``stop`` is set (`fulmen dev`, which owns the signals)."""
    from fulmen.cli.dev import serve_http

    sock = listen(settings)
    _announce(settings, sock)
    await serve_http(server(settings, sock), sock, stop)
