"""The backend's chat body or chunks as an Anthropic Messages response or its stream of events.

Blocks, stop reasons and the order of the events: docs/design/proxy.md.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from fulmen_llm_proxy.api.dialects import StreamedChat, ToolCalls, first_choice, logprob_tokens, usage_of
from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.errors import ProxyError


def _id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_blocks(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    """``tool_use`` blocks, or a ``text`` block for a call whose arguments are not a JSON object."""
    blocks = []
    for call in calls:
        try:
            arguments = json.loads(call["arguments"] or "{}")
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            blocks.append({"type": "tool_use", "id": call["id"] or "toolu_" + uuid.uuid4().hex[:24],
                           "name": call["name"], "input": arguments})  # fmt: skip
        else:
            text = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
            blocks.append({"type": "text", "text": text})
    return blocks


def stop_reason(
    finish_reason: Any, blocks: list[dict[str, Any]], call: Call, text: str, tokens: str
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the answer."""
    if any(b["type"] == "tool_use" for b in blocks):
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and call.stop and tokens.startswith(text):
        rest = tokens[len(text) :]
        for stop in call.stop:
            if rest.startswith(stop):
                return "stop_sequence", stop
    return "end_turn", None


def _usage(n_in: int, n_out: int) -> dict[str, int]:
    return {"input_tokens": n_in, "output_tokens": n_out, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}  # fmt: skip


def message_body(chat: dict[str, Any], call: Call) -> dict[str, Any]:
    """A non-streaming Messages body from the backend's chat body."""
    choice = first_choice(chat)
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    calls = ToolCalls()
    calls.add_message(message.get("tool_calls"))
    blocks = tool_blocks(calls.all())
    content = [{"type": "text", "text": text}] if text or not blocks else []
    content.extend(blocks)
    tokens = "".join(str(t.get("token", "")) for t in logprob_tokens(choice))
    reason, sequence = stop_reason(choice.get("finish_reason"), blocks, call, text, tokens)
    body: dict[str, Any] = {
        "id": _id(), "type": "message", "role": "assistant", "model": call.model, "content": content,
        "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(*usage_of(chat, None)),
        "model_version": str(chat.get("model_version") or ""),
    }  # fmt: skip
    if isinstance(chat.get("prompt_token_ids"), list):
        body["prompt_token_ids"] = chat["prompt_token_ids"]
    if isinstance(choice.get("token_ids"), list):
        body["token_ids"] = choice["token_ids"]
    return body


class MessagesEncoder(StreamedChat):
    """One streaming call's chat chunks as Messages events (`fulmen_llm_proxy.api.dialects.Encoder`)."""

    def __init__(self, call: Call, error_body: Callable[[ProxyError], bytes]) -> None:
        super().__init__()
        self.call, self.error_body = call, error_body
        self.started = False
        self.opened = False  # the text block
        self.tokens: list[str] = []

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps({"type": kind, **fields}).encode() + b"\n\n"

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        out = []
        choice, text = self.read(chunk)
        if not self.started:
            self.started = True
            prompt_ids = self.prompt_ids
            message: dict[str, Any] = {
                "id": _id(), "type": "message", "role": "assistant", "model": self.call.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": _usage(len(prompt_ids) if isinstance(prompt_ids, list) else 0, 0),
                "model_version": self.version,
            }  # fmt: skip
            if isinstance(prompt_ids, list):
                message["prompt_token_ids"] = prompt_ids
            out.append(self._event("message_start", message=message))
        self.tokens.extend(str(t.get("token", "")) for t in logprob_tokens(choice))
        if text:
            if not self.opened:
                self.opened = True
                out.append(self._event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
            out.append(self._event("content_block_delta", index=0, delta={"type": "text_delta", "text": text}))
        return b"".join(out)

    def end(self, result: Result) -> bytes:
        out = [self.chunk({})] if not self.started else []
        blocks = tool_blocks(self.calls.all())
        index = 0
        if self.opened or not blocks:
            if not self.opened:
                out.append(self._event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
            out.append(self._event("content_block_stop", index=0))
            index = 1
        for block in blocks:
            if block["type"] == "tool_use":
                start = {**block, "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
            else:
                start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
            out.append(self._event("content_block_start", index=index, content_block=start))
            out.append(self._event("content_block_delta", index=index, delta=delta))
            out.append(self._event("content_block_stop", index=index))
            index += 1
        text = "".join(self.texts)
        finish = result.finish_reason or self.finish_reason
        reason, sequence = stop_reason(finish, blocks, self.call, text, "".join(self.tokens))
        n_in, n_out = usage_of({"usage": self.usage}, result)
        out.append(self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                               usage=_usage(n_in, n_out), token_ids=self.token_ids,
                               model_version=result.model_version or self.version))  # fmt: skip
        out.append(self._event("message_stop"))
        return b"".join(out)

    def error(self, error: ProxyError) -> bytes:
        return b"event: error\ndata: " + self.error_body(error) + b"\n\n"
