"""A fake Anthropic Messages server on loopback (``POST /v1/messages``): scripted replies, streaming
or not, every request recorded. Modelled on `fakes.fake_openai` (its HTTP connection is reused)::

    fake = FakeAnthropic(api_key="k", replies=["4", {"tool_uses": [...]}, {"status": 529}])
    base_url = fake.start_in_thread()      # http://127.0.0.1:<port>
    ...                                     # fake.requests: every request received, in order
    fake.stop()

Replies: each request takes the next scripted reply (then ``default_reply``). A reply is a string
(the text) or a dict with any of ``content`` (text), ``tool_uses`` (``{"id", "name", "input"}``
each), ``blocks`` (the content blocks as sent, any type), ``stop_reason``, ``usage``, ``status``
with ``error_type`` / ``message`` / ``retry_after`` (an error status answers in Anthropic's error
shape, with a ``Retry-After`` header when given), ``error_event`` (streaming: an ``error`` event
after the first text delta instead of the end), ``delay_s``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from fakes.fake_openai import FakeOpenAI, Received, _Connection

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}  # fmt: skip
_STOP = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}


@dataclass
class FakeAnthropic(FakeOpenAI):
    replies: list[str | dict[str, Any]] = field(default_factory=list)
    default_reply: str = "Hello from Claude!"
    model: str = "claude-fake"
    api_key: str | None = None  # when set, requests must carry it as x-api-key

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._server = await loop.create_server(lambda: _AnthropicConnection(self), host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.base_url

    def answer(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, Any, bool, float]:
        """(status, body or list of SSE events, is_stream, delay_s); an error body carries
        ``_retry_after`` for the connection to send as a header."""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return 400, _error(400, "invalid JSON"), False, 0.0
        self.requests.append(Received(method, path, headers, body))
        if self.api_key is not None and headers.get("x-api-key") != self.api_key:
            return 401, _error(401, "invalid x-api-key"), False, 0.0
        if path != "/v1/messages" or method != "POST":
            return 404, _error(404, f"no route {method} {path}"), False, 0.0
        reply = self.next_reply()
        status, delay_s = int(reply.get("status", 200)), float(reply.get("delay_s", 0.0))
        if status != 200:
            error = _error(status, reply.get("message", "scripted error"), reply.get("error_type"))
            if reply.get("retry_after") is not None:
                error["_retry_after"] = str(reply["retry_after"])
            return status, error, False, delay_s
        message = self._message(body, reply)
        if body.get("stream"):
            return 200, self._events(message, reply), True, delay_s
        return 200, message, False, delay_s

    def _message(self, body: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
        blocks = reply.get("blocks")
        if blocks is None:
            blocks = [{"type": "text", "text": reply["content"]}] if reply.get("content") else []
            blocks += [{"type": "tool_use", **use} for use in reply.get("tool_uses") or ()]
        text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
        stop = reply.get("stop_reason") or ("tool_use" if reply.get("tool_uses") else "end_turn")
        assert stop in _STOP, stop
        return {
            "id": f"msg_fake{len(self.requests)}", "type": "message", "role": "assistant",
            "model": body.get("model") or self.model, "content": blocks, "stop_reason": stop,
            "stop_sequence": None,
            "usage": reply.get("usage") or {"input_tokens": 21, "output_tokens": max(1, len(text))},
        }  # fmt: skip

    def _events(self, message: dict[str, Any], reply: dict[str, Any]) -> list[dict[str, Any]]:
        """Anthropic's stream: each text in two deltas, each tool input in two partial JSON pieces."""
        start = {**message, "content": [], "stop_reason": None,
                 "usage": {"input_tokens": message["usage"]["input_tokens"], "output_tokens": 1}}  # fmt: skip
        events: list[dict[str, Any]] = [{"type": "message_start", "message": start}, {"type": "ping"}]
        for index, block in enumerate(message["content"]):
            if block["type"] == "text":
                first = {"type": "text", "text": ""}
                half = len(block["text"]) // 2
                deltas = [{"type": "text_delta", "text": block["text"][:half]},
                          {"type": "text_delta", "text": block["text"][half:]}]  # fmt: skip
            elif block["type"] == "tool_use":
                first = {**block, "input": {}}
                partial = json.dumps(block["input"]) if block["input"] else ""
                half = len(partial) // 2
                deltas = [{"type": "input_json_delta", "partial_json": partial[:half]},
                          {"type": "input_json_delta", "partial_json": partial[half:]}]  # fmt: skip
            else:
                first, deltas = block, []
            events.append({"type": "content_block_start", "index": index, "content_block": first})
            for delta in deltas:
                events.append({"type": "content_block_delta", "index": index, "delta": delta})
                if reply.get("error_event"):
                    events.append({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
                    return events
            events.append({"type": "content_block_stop", "index": index})
        events.append({"type": "message_delta", "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                       "usage": {"output_tokens": message["usage"]["output_tokens"]}})  # fmt: skip
        events.append({"type": "message_stop"})
        return events


def _error(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind or _ERROR_TYPES.get(status, "api_error"), "message": message}}


class _AnthropicConnection(_Connection):
    """The fake OpenAI server's connection with Anthropic's SSE (``event:`` lines, no ``[DONE]``)
    and a ``Retry-After`` header on errors that ask for one."""

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        path = self._url.decode().split("?", 1)[0]
        status, payload, stream, delay_s = self.fake.answer(method, path, self._headers, b"".join(self._body))
        if stream:
            self._task = asyncio.ensure_future(self._stream(payload, delay_s))
            return
        after = payload.pop("_retry_after", None)
        data = json.dumps(payload).encode()
        if delay_s:
            asyncio.get_running_loop().call_later(delay_s, self._send, status, data, after)
        else:
            self._send(status, data, after)

    def _send(self, status: int, data: bytes, retry_after: str | None) -> None:
        assert self.transport is not None
        extra = f"retry-after: {retry_after}\r\n" if retry_after is not None else ""
        head = (f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\ncontent-type: application/json\r\n"
                f"{extra}content-length: {len(data)}\r\n\r\n")  # fmt: skip
        self.transport.write(head.encode() + data)

    async def _stream(self, events: list[dict[str, Any]], delay_s: float) -> None:
        assert self.transport is not None
        if delay_s:
            await asyncio.sleep(delay_s)
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for event in events:
            data = b"event: " + event["type"].encode() + b"\ndata: " + json.dumps(event).encode() + b"\n\n"
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
            await asyncio.sleep(0)
        self.transport.write(b"0\r\n\r\n")
