"""The dashboard's HTTP layer as a plain ASGI app (as the LLM proxy's): a request, a response, the
auth check and a table of routes. No framework: a page is a few Redis reads and one template.

Bad input never reaches Redis: every path part and query parameter is checked first, and a failed
check is a 4xx page (`HttpError`).
"""

from __future__ import annotations

import hmac
import json
import re
from base64 import b64decode
from binascii import Error as BinasciiError
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MAX_QUERY_BYTES = 4096  # of a query string: the filters take far less
MAX_QUERY_FIELDS = 32
MAX_BODY_BYTES = 4096  # admin forms carry nothing but the action itself


class HttpError(Exception):
    """Answered as an error page with ``status``; ``message`` is shown to the user (no secrets)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    params: dict[str, str] = field(default_factory=dict)  # from the route's pattern

    @classmethod
    def from_scope(cls, scope: Scope) -> Request:
        raw = scope.get("query_string", b"")
        if len(raw) > MAX_QUERY_BYTES:
            raise HttpError(414, "query string too long")
        try:
            pairs = parse_qsl(raw.decode("utf-8"), keep_blank_values=False, strict_parsing=False,
                              max_num_fields=MAX_QUERY_FIELDS)
        except (UnicodeDecodeError, ValueError):
            raise HttpError(400, "malformed query string") from None
        query: dict[str, str] = {}
        for name, value in pairs:
            if name in query:
                raise HttpError(400, f"parameter {name!r} given twice")
            query[name] = value
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        return cls(scope.get("method", "GET"), scope.get("path", "/"), query, headers)


@dataclass
class Response:
    body: bytes
    status: int = 200
    content_type: str = "text/html; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Response:
        return cls(json.dumps(value, allow_nan=False).encode(), status, "application/json")

    async def send(self, send: Send) -> None:
        headers = [
            (b"content-type", self.content_type.encode()),
            (b"content-length", str(len(self.body)).encode()),
            # pages hold run data: no framing by other sites, no guessing of types, scripts from here only
            (b"x-frame-options", b"DENY"),
            (b"x-content-type-options", b"nosniff"),
            (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'"),
            (b"referrer-policy", b"same-origin"),
            *((k.lower().encode(), v.encode()) for k, v in self.headers.items()),
        ]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


Handler = Callable[[Request], Awaitable[Response]]


class Routes:
    """(method, path pattern) -> handler; a pattern's ``{name}`` matches one path segment."""

    def __init__(self) -> None:
        self._routes: list[tuple[str, re.Pattern[str], Handler]] = []

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        regex = "^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern) + "$"
        self._routes.append((method, re.compile(regex), handler))

    def find(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        allowed = False
        for route_method, regex, handler in self._routes:
            found = regex.match(path)
            if found:
                if route_method == method or (route_method == "GET" and method == "HEAD"):
                    return handler, found.groupdict()
                allowed = True
        if allowed:
            raise HttpError(405, f"{method} is not allowed here")
        raise HttpError(404, f"no page at {path}")


class Auth:
    """The optional secret: a bearer token, or the password of HTTP basic auth (any user name, so a
    browser's own prompt works). Compared in constant time; never logged."""

    def __init__(self, secret: str | None) -> None:
        self.secret = secret.encode() if secret else None

    def check(self, request: Request) -> None:
        if self.secret is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        offered = b""
        if scheme.lower() == "bearer":
            offered = value.strip().encode()
        elif scheme.lower() == "basic":
            try:
                offered = b64decode(value.strip(), validate=True).partition(b":")[2]
            except (BinasciiError, ValueError):
                offered = b""
        if not offered or not hmac.compare_digest(offered, self.secret):
            raise HttpError(401, "authentication required", {"www-authenticate": 'Basic realm="fulmen"'})


def same_origin(request: Request) -> None:
    """A state-changing request must come from the dashboard's own pages: a browser that holds the
    basic-auth password would send it along with a form posted from another site."""
    origin = request.headers.get("origin")
    host = request.headers.get("host", "")
    if origin is not None and re.sub(r"^https?://", "", origin) != host:
        raise HttpError(403, "cross-site request refused")
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise HttpError(403, "cross-site request refused")


async def read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return body
        body += message.get("body", b"")
        if len(body) > MAX_BODY_BYTES:
            raise HttpError(413, "request body too large")
        if not message.get("more_body"):
            return body
