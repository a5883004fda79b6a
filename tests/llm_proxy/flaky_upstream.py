"""A scripted, flaky OpenAI-compatible upstream on loopback: 429 with Retry-After, 5xx, slow answers.

Plain asyncio streams, keep-alive, in a thread of its own (so sync clients and a proxy in another
thread can call it). Each request takes the next scripted reply (then a 200 chat completion) and
is recorded with its arrival time::

    up = FlakyUpstream().start()
    up.script({"status": 429, "headers": {"retry-after": "1"}}, {"status": 500}, {"delay_s": 5}, {"break": True})
    ... up.requests  # [(monotonic time, path, body), ...]
    up.stop()
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from typing import Any


def completion(text: str = "ok", usage: int = 10, stream: bool = False) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {
        "id": "chatcmpl-up", "object": "chat.completion", "created": 0, "model": "up-model",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": usage - 2, "completion_tokens": 2, "total_tokens": usage},
    }  # fmt: skip


class FlakyUpstream:
    def __init__(self) -> None:
        self.replies: deque[dict[str, Any]] = deque()
        self.requests: list[tuple[float, str, dict[str, Any]]] = []
        self.headers: list[dict[str, str]] = []  # each request's headers, lowercase names
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port = 0
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def script(self, *replies: dict[str, Any]) -> None:
        self.replies.clear()
        self.replies.extend(replies)
        self.requests.clear()
        self.headers.clear()

    def start(self) -> FlakyUpstream:
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            self._server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self.loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        """Close the server and end every connection's handler while the loop still runs."""
        if self._server is not None:
            self._server.close()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = json.loads(await reader.readexactly(int(headers.get("content-length", "0"))) or b"{}")
                self.requests.append((time.monotonic(), path, body))
                self.headers.append(headers)
                reply = self.replies.popleft() if self.replies else {}
                if reply.get("delay_s"):
                    await asyncio.sleep(reply["delay_s"])
                if reply.get("break"):  # half a reply, then the connection drops (a crash)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{")
                    await writer.drain()
                    return
                status = reply.get("status", 200)
                if status == 200 and body.get("stream"):
                    await self._stream(writer, reply)
                    continue
                payload = json.dumps(
                    reply.get("body") or (completion(**reply.get("completion", {})) if status == 200
                                          else {"error": {"message": f"scripted {status}"}})
                ).encode()  # fmt: skip
                extra = "".join(f"{k}: {v}\r\n" for k, v in reply.get("headers", {}).items())
                writer.write(
                    f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
                    f"{extra}\r\n".encode() + payload
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, reply: dict[str, Any]) -> None:
        chunk = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 0, "model": "up-model",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
        data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
        await writer.drain()
