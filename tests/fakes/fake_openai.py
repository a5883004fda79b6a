"""A fake OpenAI-compatible server on loopback: chat and text completions, streaming or not,
scripted replies, and a vLLM mode that returns token ids and log-probabilities.

Cheap on purpose (a raw asyncio protocol with httptools' parser, keep-alive, no framework), so a
benchmark can use it as an upstream that answers at once. Use it in tests::

    fake = FakeOpenAI(vllm=True, replies=["4", {"tool_calls": [...]}, {"status": 500}])
    base_url = fake.start_in_thread()      # http://127.0.0.1:<port>  (or: await fake.start())
    ...                                     # fake.requests: every request received, in order
    fake.stop()

or as a process: ``python tests/fakes/fake_openai.py --port 0 [--vllm]`` prints its base URL.

Replies: each request takes the next scripted reply (then ``default_reply``). A reply is a string
(the text) or a dict with any of ``content``, ``tool_calls``, ``finish_reason``, ``status`` and
``error`` (an error status answers with an OpenAI-style error body), ``delay_s``.

vLLM mode tokenizes by character: a token id is ``ord(char)``; the prompt is the messages'
contents joined (chat) or the prompt string; response log-probabilities are ``-0.01 * (i + 1)``.
Fields as vLLM names them with ``return_token_ids``: ``prompt_token_ids`` at the top level (and in
the choice for completions), ``token_ids`` in each choice, logprobs in the OpenAI shapes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httptools


def token_ids(text: str) -> list[int]:
    """The fake's tokenizer: one token per character."""
    return [ord(c) for c in text]


def fake_logprobs(n: int) -> list[float]:
    return [-0.01 * (i + 1) for i in range(n)]


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeOpenAI:
    vllm: bool = False
    replies: list[str | dict[str, Any]] = field(default_factory=list)
    default_reply: str = "Hello!"
    model: str = "fake-model"
    api_key: str | None = None  # when set, requests must carry it as a bearer token
    name: str = "fake"  # tells replicas apart (the ``system_fingerprint`` of each response)
    record: bool = True  # keep every request in ``requests`` (a benchmark turns it off)

    def __post_init__(self) -> None:
        self.requests: list[Received] = []
        self._script: deque[str | dict[str, Any]] = deque(self.replies)
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def script(self, *replies: str | dict[str, Any]) -> None:
        """Queue more replies."""
        self._script.extend(replies)

    # --- lifecycle ------------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._server = await loop.create_server(lambda: _Connection(self), host, port, backlog=2048)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.base_url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def start_in_thread(self) -> str:
        """Serve from a thread with its own event loop (for sync tests); returns the base URL."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.close())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"fake-openai-{self.name}", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self.base_url

    def stop(self) -> None:
        if self._thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    # --- answering ------------------------------------------------------------------------------------

    def next_reply(self) -> dict[str, Any]:
        reply = self._script.popleft() if self._script else self.default_reply
        return {"content": reply} if isinstance(reply, str) else dict(reply)

    def answer(
        self, method: str, path: str, headers: dict[str, str], raw: bytes
    ) -> tuple[int, Any, bool, float]:
        """(status, body or list of SSE events, is_stream, delay_s) for one request."""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return 400, _error(400, "invalid JSON"), False, 0.0
        if self.record:
            self.requests.append(Received(method, path, headers, body))
        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            return 401, _error(401, "bad api key"), False, 0.0
        if path.endswith("/models"):
            return (
                200,
                {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "fake"}]},
                False,
                0.0,
            )
        if path.endswith("/chat/completions"):
            chat = True
        elif path.endswith("/completions"):
            chat = False
        else:
            return 404, _error(404, f"no route {path}"), False, 0.0
        reply = self.next_reply()
        status = int(reply.get("status", 200))
        delay_s = float(reply.get("delay_s", 0.0))
        if status != 200:
            return status, _error(status, reply.get("error", "scripted error")), False, delay_s
        if body.get("stream"):
            return 200, self._events(body, reply, chat), True, delay_s
        return 200, self._completion(body, reply, chat), False, delay_s

    def _prompt(self, body: dict[str, Any], chat: bool) -> str:
        if chat:
            parts = []
            for m in body.get("messages") or ():
                content = m.get("content")
                parts.append(content if isinstance(content, str) else "")
            return "".join(parts)
        prompt = body.get("prompt") or ""
        return prompt if isinstance(prompt, str) else ""

    def _token_fields(self, body: dict[str, Any]) -> bool:
        return self.vllm and bool(body.get("return_token_ids"))

    def _completion(self, body: dict[str, Any], reply: dict[str, Any], chat: bool) -> dict[str, Any]:
        text = reply.get("content") or ""
        prompt = self._prompt(body, chat)
        finish = reply.get("finish_reason") or ("tool_calls" if reply.get("tool_calls") else "stop")
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        ids = token_ids(text)
        with_ids = self._token_fields(body)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if reply.get("tool_calls"):
                message["tool_calls"] = reply["tool_calls"]
            choice["message"] = message
            if self.vllm and body.get("logprobs"):
                choice["logprobs"] = {
                    "content": [
                        {"token": c, "logprob": lp, "bytes": list(c.encode()), "top_logprobs": []}
                        for c, lp in zip(text, fake_logprobs(len(text)), strict=True)
                    ]
                }
            else:
                choice["logprobs"] = None
        else:
            choice["text"] = text
            if self.vllm and body.get("logprobs") is not None:
                choice["logprobs"] = {
                    "tokens": list(text), "token_logprobs": fake_logprobs(len(text)),
                    "top_logprobs": None, "text_offset": list(range(len(text))),
                }  # fmt: skip
            else:
                choice["logprobs"] = None
            if with_ids:
                choice["prompt_token_ids"] = token_ids(prompt)
        if with_ids:
            choice["token_ids"] = ids
        response: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-fake{len(self.requests)}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model,
            "system_fingerprint": self.name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }
        if with_ids and chat:
            response["prompt_token_ids"] = token_ids(prompt)
        return response

    def _events(self, body: dict[str, Any], reply: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
        text = reply.get("content") or ""
        prompt = self._prompt(body, chat)
        with_ids = self._token_fields(body)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-fake{len(self.requests)}"
        base = {
            "id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": body.get("model") or self.model, "system_fingerprint": self.name,
        }  # fmt: skip
        events = []
        logprobs = fake_logprobs(len(text))
        pieces: list[dict[str, Any]] = [
            {"text": c, "logprob": lp} for c, lp in zip(text, logprobs, strict=True)
        ]
        if chat and reply.get("tool_calls"):
            for i, call in enumerate(reply["tool_calls"]):
                args = call["function"]["arguments"]
                half = len(args) // 2
                first = {"index": i, "id": call["id"], "type": "function",
                         "function": {"name": call["function"]["name"], "arguments": args[:half]}}  # fmt: skip
                pieces.append({"tool_call": first})
                pieces.append({"tool_call": {"index": i, "function": {"arguments": args[half:]}}})
        for n, piece in enumerate(pieces):
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            c = piece.get("text", "")
            if chat:
                delta: dict[str, Any] = (
                    {"content": c} if "text" in piece else {"tool_calls": [piece["tool_call"]]}
                )
                if n == 0:
                    delta["role"] = "assistant"
                choice["delta"] = delta
                if "text" in piece and self.vllm and body.get("logprobs"):
                    entry = {
                        "token": c,
                        "logprob": piece["logprob"],
                        "bytes": list(c.encode()),
                        "top_logprobs": [],
                    }
                    choice["logprobs"] = {"content": [entry]}
            else:
                choice["text"] = c
                if self.vllm and body.get("logprobs") is not None:
                    choice["logprobs"] = {"tokens": [c], "token_logprobs": [piece["logprob"]], "top_logprobs": None,
                                          "text_offset": [n]}  # fmt: skip
                if with_ids and n == 0:
                    choice["prompt_token_ids"] = token_ids(prompt)
            if with_ids:
                choice["token_ids"] = token_ids(c) if "text" in piece else []
            event = {**base, "choices": [choice]}
            if with_ids and chat and n == 0:
                event["prompt_token_ids"] = token_ids(prompt)
            events.append(event)
        finish = reply.get("finish_reason") or ("tool_calls" if reply.get("tool_calls") else "stop")
        last: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            last["delta"] = {}
        else:
            last["text"] = ""
        events.append({**base, "choices": [last]})
        if (body.get("stream_options") or {}).get("include_usage"):
            n_out = len(token_ids(text))
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": n_out,
                "total_tokens": len(prompt) + n_out,
            }
            events.append({**base, "choices": [], "usage": usage})
        return events


def _error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "fake_error", "param": None, "code": status}}


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests are answered in order."""

    def __init__(self, fake: FakeOpenAI) -> None:
        self.fake = fake
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._task: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        path = self._url.decode().split("?", 1)[0]
        status, payload, stream, delay_s = self.fake.answer(method, path, self._headers, b"".join(self._body))
        if stream:
            self._task = asyncio.ensure_future(self._stream(payload, delay_s))  # a reference until done
        elif delay_s:
            asyncio.get_running_loop().call_later(delay_s, self._write, status, json.dumps(payload).encode())
        else:
            self._write(status, json.dumps(payload).encode())

    def _write(self, status: int, data: bytes) -> None:
        assert self.transport is not None
        head = (
            f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
        )
        self.transport.write(head.encode() + data)

    async def _stream(self, events: list[dict[str, Any]], delay_s: float) -> None:
        assert self.transport is not None
        if delay_s:
            await asyncio.sleep(delay_s)
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for event in [*(json.dumps(e).encode() for e in events), b"[DONE]"]:
            data = b"data: " + event + b"\n\n"
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
            await asyncio.sleep(0)  # let the client see chunks arrive one by one
        self.transport.write(b"0\r\n\r\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--vllm", action="store_true", help="return token ids and logprobs (vLLM's fields)")
    parser.add_argument("--reply", default="Hello!", help="the text of every reply")
    args = parser.parse_args()

    async def serve() -> None:
        fake = FakeOpenAI(vllm=args.vllm, default_reply=args.reply, record=False)
        await fake.start(args.host, args.port)
        print(fake.base_url, flush=True)
        await asyncio.Event().wait()

    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(serve())
        else:
            uvloop.run(serve())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
