"""`/healthz`, `/readyz` and Prometheus `/metrics` for any service, plus its heartbeat in the store.

Served from background threads with their own sync Redis client, so a busy loop never looks dead.
Port, address and token rules: docs/design/telemetry.md.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.core import Metric
from redis.exceptions import RedisError

from fulmen import keys as k
from fulmen.errors import InvalidInput
from fulmen.records import ServiceBeat
from fulmen.settings import CommonSettings
from fulmen.store.redis.connection import sync_client
from fulmen.telemetry.metrics import PipelineCollector

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # `fulmen top` counts a service live while its beat is younger than 3 of these
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def ops_port(settings: CommonSettings) -> int | None:
    """FULMEN_METRICS_PORT, else $PORT, else None (no server)."""
    if settings.metrics_port is not None:
        return settings.metrics_port
    port = os.environ.get("PORT", "").strip()
    return int(port) if port.isdigit() else None


def readiness(client: redis.Redis, keys: k.Keys, groups: Sequence[tuple[str, str]]) -> str | None:
    """None when ready; else why not. ``groups``: (Keys attribute of a stream, group) pairs."""
    try:
        pipe = client.pipeline(transaction=False)
        pipe.ping()
        for stream, _ in groups:
            pipe.xinfo_groups(getattr(keys, stream))
        replies = pipe.execute(raise_on_error=False)
    except (RedisError, OSError) as e:
        return f"redis unreachable: {type(e).__name__}"  # the message could carry the URL: leave it out
    if isinstance(replies[0], Exception):
        return f"redis unreachable: {type(replies[0]).__name__}"
    for (stream, group), reply in zip(groups, replies[1:], strict=True):
        names = [] if isinstance(reply, Exception) else [_text(info.get("name")) for info in reply]
        if group not in names:
            return f"consumer group {group!r} on {getattr(keys, stream)} is missing"
    return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Registry:
    """What /metrics renders: the default registry (process metrics) and the service's collectors."""

    def __init__(self, collectors: list[Any]) -> None:
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        for collector in [REGISTRY, *self.collectors]:
            try:
                yield from collector.collect()
            except Exception:  # one failing collector must not blank the whole page
                log.exception("metrics collector %r failed", collector)


class OpsServer:
    """One service process's health, readiness and metrics endpoints, and its heartbeat."""

    def __init__(
        self,
        settings: CommonSettings,
        service: str,
        *,
        groups: Sequence[tuple[str, str]] = (),
        port: int | None = None,
        host: str | None = None,
        token: str | None = None,
        any_port_if_taken: bool = False,
    ) -> None:
        self.service = service
        self.any_port_if_taken = any_port_if_taken  # ``port`` is a hint (honcho's $PORT), not the user's choice
        self.keys = k.Keys(settings.experiment)
        self.groups = list(groups)
        self.port = port
        self.host = settings.metrics_host if host is None else host
        if token is None and settings.metrics_token is not None:
            token = settings.metrics_token.get_secret_value()
        self.token = token.encode() if token else None  # what /metrics requires (None: nothing)
        # short timeouts: a probe must answer "not ready" quickly, not hang with a dead Redis
        self.redis = sync_client(  # a cluster client for a cluster URL
            settings.redis_url_value(), socket_timeout=2.0, socket_connect_timeout=2.0
        )
        self.collectors: list[Any] = [PipelineCollector(self.redis, self.keys)]
        self.instance = f"{service}-{socket.gethostname()}-{os.getpid()}"
        self.started = time.time()
        self._stop = threading.Event()
        self._http: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    def add(self, collector: Any) -> None:
        """Serve ``collector`` (anything with ``collect()``, a CollectorRegistry too) on /metrics."""
        self.collectors.append(collector)

    def metrics(self) -> bytes:
        return generate_latest(_Registry(self.collectors))  # type: ignore[arg-type]

    def ready(self) -> str | None:
        return readiness(self.redis, self.keys, self.groups)

    def authorized(self, authorization: str | None) -> bool:
        """Whether a request may read /metrics: no token configured, or the right bearer token."""
        if self.token is None:
            return True
        given = (authorization or "").encode("utf-8", "replace")
        token = given[7:].strip() if given[:7].lower() == b"bearer " else b""
        return hmac.compare_digest(token, self.token)  # constant time: timing says nothing of the token

    def start(self) -> OpsServer:
        if self._threads:
            return self  # already started (`with start_ops(...)` starts it before entering)
        if self.port is not None:
            self._http = self._bind(self.port)
            self._http.daemon_threads = True
            self.port = self._http.server_address[1]  # port 0: the one the OS picked
            self._spawn(self._http.serve_forever, "ops-http")
            log.info("%s: /healthz /readyz /metrics on %s port %d%s", self.service, self.host, self.port,
                     " (/metrics needs the bearer token)" if self.token else "")
        self._spawn(self._beat, "ops-heartbeat")
        return self

    def _bind(self, port: int) -> ThreadingHTTPServer:
        """The HTTP server on ``port``; a port taken by another process is a clear error, or, when the
        port was only honcho's $PORT (a second `honcho start` hands out the same ones), a free port with
        a warning: the service's heartbeat names the port, so `fulmen top` still finds it."""
        try:
            return ThreadingHTTPServer((self.host, port), _handler(self))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            if not self.any_port_if_taken:
                raise InvalidInput(f"{self.service}: port {port} for /healthz /readyz /metrics is taken: set "
                                   "FULMEN_METRICS_PORT to a free port, or 0 for any") from None
        log.warning("%s: port %d ($PORT) is taken, another `honcho start` on this host? Serving /healthz /readyz "
                    "/metrics on a free port instead (set FULMEN_METRICS_PORT, or `honcho start -p`, to choose)",
                    self.service, port)
        return ThreadingHTTPServer((self.host, 0), _handler(self))

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)  # never holds the exit
        thread.start()
        self._threads.append(thread)

    def _beat(self) -> None:
        while not self._stop.is_set():
            beat = ServiceBeat(
                self.service, self.instance, socket.gethostname(), os.getpid(), self.port, self.started, time.time()
            )
            try:
                self.redis.hset(self.keys.services, self.instance, beat.to_wire())
            except (RedisError, OSError) as e:
                log.debug("service heartbeat failed: %s", type(e).__name__)
            self._stop.wait(HEARTBEAT_S)

    def stop(self) -> None:
        """Stop serving and remove the heartbeat (a clean exit is not a dead replica)."""
        self._stop.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        for thread in self._threads:
            thread.join(timeout=2.0)
        with contextlib.suppress(RedisError, OSError):
            self.redis.hdel(self.keys.services, self.instance)
        self.redis.close()

    def __enter__(self) -> OpsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_ops(settings: CommonSettings, service: str, groups: Sequence[tuple[str, str]] = ()) -> OpsServer:
    """Start `OpsServer` for a service on its configured port (see the module docstring)."""
    return OpsServer(settings, service, groups=groups, port=ops_port(settings),
                     any_port_if_taken=settings.metrics_port is None).start()


def _handler(server: OpsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the http.server protocol's name
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._send(200, b'{"status":"ok"}', "application/json")
            elif path == "/readyz":
                reason = server.ready()
                body = {"ready": True} if reason is None else {"ready": False, "reason": reason}
                self._send(200 if reason is None else 503, json.dumps(body).encode(), "application/json")
            elif path == "/metrics":
                if server.authorized(self.headers.get("Authorization")):
                    self._send(200, server.metrics(), METRICS_CONTENT_TYPE)
                else:
                    self._send(401, b'{"error":"missing or invalid bearer token"}', "application/json")
            else:
                self._send(404, b'{"error":"no such path"}', "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a line per probe would drown the service's own log

    return Handler
