"""How the proxy's HTTP server writes a whole response (`fulmen_llm_proxy.server`, the app's RESPOND)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn

from fulmen_llm_proxy.app import RESPOND, Out
from fulmen_llm_proxy.server import _Protocol


class _App:
    """An ASGI app that answers each request with `Out.body`, noting whether RESPOND took it."""

    def __init__(self) -> None:
        self.took: list[bool] = []

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        out = Out(scope, send)  # type: ignore[arg-type]
        self.took.append(out.respond is not None)
        version = "v\n1" if scope["path"] == "/bad" else "v1"
        await out.body(200, b'{"ok":1}', version=version)


@pytest.fixture
async def server() -> AsyncIterator[tuple[_App, int]]:
    app = _App()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=_Protocol, lifespan="off", access_log=False, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    yield app, sock.getsockname()[1]
    server.should_exit = True
    await task


async def _exchange(port: int, request: bytes, replies: int = 1) -> list[bytes]:
    """Send ``request`` (one or more) and read ``replies`` whole responses, each as its one read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    out = []
    for _ in range(replies):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        out.append(head + await reader.readexactly(length))
    writer.close()
    return out


GET = b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n"


async def test_a_whole_response_goes_as_one_write_with_the_default_headers(server: tuple[_App, int]) -> None:
    """Under the proxy's server the app's response is written by RESPOND: status, uvicorn's date and
    server headers, the app's headers and its body, and the connection stays open for the next."""
    app, port = server
    first, second = await _exchange(port, GET + GET, replies=2)
    assert app.took == [True, True]
    head, _, body = first.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK"
    names = [line.split(b":")[0] for line in lines[1:]]
    assert names == [b"date", b"server", b"content-type", b"content-length", b"x-fulmen-model-version"]
    assert b"x-fulmen-model-version: v1" in lines and body == b'{"ok":1}'
    assert second.endswith(b'{"ok":1}')


async def test_connection_close_is_honoured(server: tuple[_App, int]) -> None:
    """A request asking to close gets "connection: close" and the server closes after the response."""
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /x HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5)  # to the end: the server closed
    assert b"connection: close\r\n" in data and data.endswith(b'{"ok":1}')
    writer.close()


async def test_a_header_value_uvicorn_would_refuse_goes_through_uvicorn(server: tuple[_App, int]) -> None:
    """A header value with a newline is not written by RESPOND: uvicorn's send refuses it and closes
    the connection (nothing of the response is written), as without the extension."""
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /bad HTTP/1.1\r\nhost: t\r\n\r\n")
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


def test_without_the_extension_the_app_sends_asgi_messages() -> None:
    """Under another server (no RESPOND in the scope) the response goes as the two ASGI messages."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    out = Out({"type": "http"}, send)
    assert out.respond is None
    asyncio.run(out.body(201, b"{}"))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 201 and (b"content-length", b"2") in sent[0]["headers"]
    assert RESPOND == "fulmen.respond"
