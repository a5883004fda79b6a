"""A minimal HTTP/1.1 client for JSON POSTs: keep-alive connection pool, httptools parser.

POST only, one request per connection at a time. Why not aiohttp, and its scope: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

CONNECT_TIMEOUT_S = 10.0
# Idle keep-alive connections kept per upstream: enough for the proxy's concurrent calls to reuse
# theirs; beyond it a connection is closed after its reply rather than held open.
MAX_IDLE_CONNECTIONS = 256


class StaleConnection(ConnectionError):
    """The connection closed before any byte of the reply came: the request can be sent again."""


class _Connection(asyncio.Protocol):
    __slots__ = (
        "_body",
        "_done",
        "_got_bytes",
        "_pieces",
        "closed",
        "keep_alive",
        "parser",
        "retry_after",
        "status",
        "transport",
    )

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.keep_alive = True
        self.status = 0
        self.retry_after: bytes | None = None  # the reply's Retry-After header, when it has one
        self._body: list[bytes] = []
        self._done: asyncio.Future[None] | None = None
        self._pieces: asyncio.Queue[bytes | BaseException | None] | None = None  # streaming mode
        self._got_bytes = False

    # --- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionError(f"bad HTTP reply: {e}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._got_bytes:
            self._fail(ConnectionError("the upstream closed the connection mid-reply"))
        else:
            self._fail(StaleConnection("the upstream closed the connection"))

    # --- httptools callbacks ------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        # one length check per header: the only one read is Retry-After (a 429's or 503's)
        if len(name) == 11 and name.lower() == b"retry-after":
            self.retry_after = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self._pieces is not None and self._done is not None and not self._done.done():
            self._done.set_result(None)  # streaming: the status is known, pieces follow

    def on_body(self, body: bytes) -> None:
        if self._pieces is not None:
            self._pieces.put_nowait(body)
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._pieces is not None:
            self._pieces.put_nowait(None)
        elif self._done is not None and not self._done.done():
            self._done.set_result(None)

    # --- use ------------------------------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        if self._pieces is not None:
            self._pieces.put_nowait(error)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def send(self, data: bytes, stream: bool) -> asyncio.Future[None]:
        """Write a request; the future resolves when the reply (or, streaming, its head) is in."""
        assert self.transport is not None
        self._body = []
        self._got_bytes = False
        self.retry_after = None
        self._pieces = asyncio.Queue() if stream else None
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self._done

    def body(self) -> bytes:
        return b"".join(self._body)

    async def pieces(self) -> AsyncIterator[bytes]:
        assert self._pieces is not None
        while True:
            item = await self._pieces.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class HttpPool:
    """Keep-alive connections to one origin (scheme, host, port), with a path prefix."""

    def __init__(
        self, base_url: str, headers: dict[str, str] | None = None, max_idle: int = MAX_IDLE_CONNECTIONS
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream URL {base_url!r} must be http:// or https:// with a host")
        self.base_url = base_url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        host_header = parts.netloc.rsplit("@", 1)[-1]
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"HTTP/1.1\r\nhost: {host_header}\r\ncontent-type: application/json\r\n{extra}".encode()
        self._idle: deque[_Connection] = deque()
        self.max_idle = max_idle

    def _request(self, path: str, payload: bytes) -> bytes:
        return b"POST %s%s %scontent-length: %d\r\n\r\n%s" % (
            self.prefix.encode(), path.encode(), self._head, len(payload), payload,
        )  # fmt: skip

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl), CONNECT_TIMEOUT_S
        )
        return conn

    def _acquire_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return None

    def _release(self, conn: _Connection) -> None:
        if conn.keep_alive and not conn.closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.abort()

    async def _send(self, data: bytes, stream: bool) -> _Connection:
        """Send on an idle connection (once more on a new one if it was stale); raises OSError when
        no connection can be made (nothing was sent)."""
        conn = self._acquire_idle()
        if conn is not None:
            try:
                await conn.send(data, stream)
                return conn
            except StaleConnection:
                pass  # closed by the server while idle: the request never reached it
            except BaseException:
                conn.abort()  # cancelled (a timeout) or failed mid-reply: the connection is unusable
                raise
        conn = await self._connect()
        try:
            await conn.send(data, stream)
        except BaseException:
            conn.abort()
            raise
        return conn

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        """POST and read the whole reply: (status, body)."""
        status, body, _ = await self.post_reply(path, payload)
        return status, body

    async def post_reply(self, path: str, payload: bytes) -> tuple[int, bytes, bytes | None]:
        """POST and read the whole reply: (status, body, its Retry-After header or None)."""
        conn = await self._send(self._request(path, payload), stream=False)
        status, body, after = conn.status, conn.body(), conn.retry_after
        self._release(conn)
        return status, body, after

    async def post_stream(self, path: str, payload: bytes) -> tuple[int, _Connection]:
        """POST and return (status, connection) once the reply's head is in; read the body with
        ``stream_body`` (which gives the connection back)."""
        conn = await self._send(self._request(path, payload), stream=True)
        return conn.status, conn

    async def stream_body(self, conn: _Connection) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for piece in conn.pieces():
                yield piece
            finished = True
        finally:
            if finished:
                self._release(conn)
            else:
                conn.abort()  # the reader stopped early: the rest of the reply is not wanted

    def close(self) -> None:
        while self._idle:
            self._idle.pop().abort()
