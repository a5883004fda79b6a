"""The proxy's HTTP server (`fulmen_llm_proxy.server`): whole responses in one write (the app's RESPOND) and the connection deadlines."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn

from fulmen_llm_proxy import server as server_module
from fulmen_llm_proxy.app import RESPOND, Out
from fulmen_llm_proxy.server import _Protocol


class _App:
    """An ASGI app that answers each request with `Out.body`, noting whether RESPOND took it."""

    def __init__(self) -> None:
        self.took: list[bool] = []

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "POST":  # the whole body first, as the proxy reads it
            message = await receive()  # type: ignore[operator]
            while message.get("more_body"):
                message = await receive()  # type: ignore[operator]
            if message["type"] == "http.disconnect":
                return
        out = Out(scope, send)  # type: ignore[arg-type]
        self.took.append(out.respond is not None)
        version = "v\n1" if scope["path"] == "/bad" else "v1"
        await out.body(200, b'{"ok":1}', version=version)


KEEP_ALIVE_S = 0.6


@pytest.fixture
async def served() -> AsyncIterator[tuple[_App, int, uvicorn.Server]]:
    app = _App()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=_Protocol, lifespan="off", access_log=False, log_level="warning",
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    yield app, sock.getsockname()[1], server
    server.should_exit = True
    await task


@pytest.fixture
def server(served: tuple[_App, int, uvicorn.Server]) -> tuple[_App, int]:
    return served[0], served[1]


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


async def test_an_idle_connection_is_closed_after_the_keep_alive_and_requests_arm_no_timer(
        served: tuple[_App, int, uvicorn.Server]) -> None:
    """Requests on one connection move its one timer on rather than arming their own; once idle for
    the keep-alive, the server closes the connection."""
    _, port, server = served
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(GET)
    await reader.readuntil(b'{"ok":1}')
    (protocol,) = server.server_state.connections
    timer = protocol._timer
    for _ in range(5):
        writer.write(GET)
        await reader.readuntil(b'{"ok":1}')
    assert protocol._timer is timer and protocol.timeout_keep_alive_task is None
    idle_since = loop.time()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
    assert loop.time() - idle_since >= KEEP_ALIVE_S - 0.05
    writer.close()


async def test_a_request_read_too_slowly_is_cut_off(served: tuple[_App, int, uvicorn.Server],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose bytes stop coming is closed at the read deadline, keep-alive or not."""
    monkeypatch.setattr(server_module, "REQUEST_READ_TIMEOUT_S", 0.3)
    _, port, _ = served
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = loop.time()
    writer.write(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 10\r\n\r\n{")
    assert await asyncio.wait_for(reader.read(), 5) == b""  # no response: a keep-alive deadline never came
    assert loop.time() - started >= 0.25
    writer.close()
