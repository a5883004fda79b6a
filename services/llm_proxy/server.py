"""Run the proxy app under uvicorn: httptools parser, uvloop when installed, no access log.

The socket is bound here (so ``--proxy-port 0`` works); `_Protocol` adds a request read timeout and
the app's `RESPOND` extension, a response with a length in one call and one write.
Why: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from functools import partial

import uvicorn
from uvicorn.protocols.http.httptools_impl import (
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from fulmen.settings import ProxySettings
from fulmen_llm_proxy.app import RESPOND, ProxyApp
from fulmen_llm_proxy.backends.base import Backend
from fulmen_llm_proxy.registry import default_base_url
from fulmen_llm_proxy.service import ProxyService

DEFAULT_PORT = 8000
# Connections the kernel queues before uvicorn accepts them: a burst of agents connecting at once
# (a new GRPO group) waits in the queue rather than being refused.
LISTEN_BACKLOG = 2048
KEEP_ALIVE_S = 75  # agents keep connections open between turns
GRACEFUL_SHUTDOWN_S = 3  # in-flight calls get 3 s; then cancelled, shut down and gone before honcho's SIGKILL at 5 s
# From a request's first byte to its last (agents send a whole body at once, over loopback or a LAN).
REQUEST_READ_TIMEOUT_S = 30.0


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"the proxy cannot listen on {host}:{port} ({e.strerror}): set FULMEN_PROXY_PORT "
                               "(or --port) to a free port; runners find the proxy wherever it listens") from None
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


class _Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for reading each request (when it passes, the
    connection is closed; the request's handler, if started, sees a disconnect) and the app's
    `RESPOND` extension.

    The read deadline and the keep-alive one share one timer per connection, armed at most
    `REQUEST_READ_TIMEOUT_S` ahead and moved on when it fires, so a request arms and cancels none
    (uvicorn arms a keep-alive timer after every response and cancels it on the next request)."""

    _deadline: float | None = None  # when the connection is closed unless it moves on; None while serving
    _timer: asyncio.TimerHandle | None = None
    _timer_at = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch(REQUEST_READ_TIMEOUT_S)  # a connection that never sends a byte is half-open too

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._watch(REQUEST_READ_TIMEOUT_S)

    def on_message_complete(self) -> None:
        self._deadline = None  # read: the handler has the request
        super().on_message_complete()

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before:  # a new request's cycle (an upgrade request gets none)
            self.scope.setdefault("extensions", {})[RESPOND] = partial(
                _respond, self.cycle, self.server_state.default_headers)

    def on_response_complete(self) -> None:
        # uvicorn's, with the keep-alive deadline on the connection's one timer
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:  # the next pipelined request was read already
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self._watch(self.timeout_keep_alive)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def _watch(self, timeout_s: float) -> None:
        now = self.loop.time()
        self._deadline = deadline = now + timeout_s
        if self._timer is None or deadline < self._timer_at:  # else the armed timer comes first
            self._arm(min(deadline, now + REQUEST_READ_TIMEOUT_S))

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self.loop.call_at(when, self._check), when

    def _check(self) -> None:
        self._timer = None
        now, deadline = self.loop.time(), self._deadline
        if deadline is not None and now >= deadline:
            if not self.transport.is_closing():
                self.transport.close()
            return
        self._arm(now + REQUEST_READ_TIMEOUT_S if deadline is None else min(deadline, now + REQUEST_READ_TIMEOUT_S))


def _respond(cycle: RequestResponseCycle, defaults: list[tuple[bytes, bytes]], status: int,
             headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
    """The `fulmen_llm_proxy.app.RESPOND` extension for one request's ``cycle``: its whole response in
    one write, with the server's default headers (date, server), as uvicorn's ``send`` writes a head
    and a body, minus its checks of headers it did not make."""
    if (cycle.response_started or cycle.disconnected or cycle.flow.write_paused or status not in STATUS_LINE
            or cycle.scope["method"] == "HEAD"):
        return False
    for _, value in headers:
        if HEADER_VALUE_RE.search(value):  # uvicorn's send refuses it (a 500)
            return False
    parts = [STATUS_LINE[status]]
    for name, value in defaults:
        parts += (name, b": ", value, b"\r\n")
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if not cycle.keep_alive:
        parts.append(b"connection: close\r\n")
    parts += (b"\r\n", body)
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.transport.write(b"".join(parts))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
    return True


def loop_name() -> str:
    try:
        import uvloop  # noqa: F401 - only probing
    except ImportError:
        return "asyncio"
    return "uvloop"


def build(
    settings: ProxySettings, sock: socket.socket, backend: Backend | None = None, stop: asyncio.Event | None = None
) -> tuple[ProxyApp, uvicorn.Config]:
    """The app for ``settings`` on an already bound socket, and a uvicorn config to serve it; ``stop``
    set while the app starts, it neither registers nor serves (`ProxyService.start`)."""
    port = sock.getsockname()[1]
    base_url = settings.proxy_public_url or default_base_url(settings.proxy_host, port)
    app = ProxyApp(ProxyService(settings, base_url.rstrip("/"), backend, stopping=stop))
    config = uvicorn.Config(
        app,
        http=_Protocol,
        loop=loop_name(),
        lifespan="on",
        access_log=False,  # one log line per request would cost more CPU than the request
        proxy_headers=False,  # no X-Forwarded-* rewriting: one middleware layer less per request
        log_level=settings.log_level.lower(),
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        backlog=LISTEN_BACKLOG,
    )
    return app, config


class _NoCancelledTracebacks(logging.Filter):
    """uvicorn logs each call it cancels when the graceful shutdown runs out as an "Exception in ASGI
    application" with its traceback (hundreds under load, while honcho's 5 s run): its one line
    "Cancel N running task(s)" says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop the proxy runs on as a process of its own: uvloop when installed (`loop_name`)."""
    return uvicorn.Config(None, loop=loop_name()).get_loop_factory()


async def serve(settings: ProxySettings, stop: asyncio.Event) -> None:
    """Serve in the running loop until ``stop`` is set (whoever sets it owns the signals). The backend
    is made in a thread (the torch one imports torch: seconds, tens on a busy machine), so SIGTERM
    meanwhile stops the proxy at once."""
    from fulmen.cli.service import before_stop, serve_http
    from fulmen_llm_proxy.backends.registry import LOCAL_BACKENDS, make_backend

    port = (
        settings.proxy_port if settings.proxy_port is not None else int(os.environ.get("PORT", DEFAULT_PORT))
    )
    sock = bind(settings.proxy_host, port)
    try:  # a local backend imports torch in its thread; an upstream one needs the loop, and is quick
        backend = (await before_stop(asyncio.to_thread(make_backend, settings), stop, "importing torch")
                   if settings.proxy_backend in LOCAL_BACKENDS else make_backend(settings))
    except BaseException:
        sock.close()
        raise
    _, config = build(settings, sock, backend, stop)
    logging.getLogger("uvicorn.error").addFilter(_NoCancelledTracebacks())
    await serve_http(uvicorn.Server(config), sock, stop)
