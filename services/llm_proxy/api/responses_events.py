"""The backend's chat body or chunks as a Responses API response or its stream of events.

Output items and the order of the events: docs/design/proxy.md.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fulmen_llm_proxy.api.dialects import StreamedChat, ToolCalls, first_choice, logprob_tokens, usage_of
from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.errors import ProxyError

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _wants_logprobs(request: dict[str, Any]) -> bool:
    return LOGPROBS_INCLUDE in (request.get("include") or ())


def _logprobs(tokens: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"token": t.get("token", ""), "logprob": t.get("logprob", 0.0), "bytes": t.get("bytes") or [],
         "top_logprobs": []}
        for t in tokens
    ]  # fmt: skip


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def _message(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _function_call(call: dict[str, str], status: str, arguments: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call", "id": "fc_" + (call["id"] or uuid.uuid4().hex[:24]),
        "call_id": call["id"], "name": call["name"],
        "arguments": call["arguments"] if arguments is None else arguments, "status": status,
    }  # fmt: skip


def envelope(request: dict[str, Any], call: Call, rid: str, created: int, status: str) -> dict[str, Any]:
    """The response object without output and usage: what the request asked for, echoed."""
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": None, "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"), "metadata": request.get("metadata") or {},
        "model": call.model, "output": [], "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "temperature": call.temperature, "tool_choice": request.get("tool_choice") or "auto",
        "tools": request.get("tools") or [], "top_p": call.top_p, "store": False,
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": None,
    }  # fmt: skip


def _finish(
    response: dict[str, Any], finish_reason: str | None, n_in: int, n_out: int,
    prompt_ids: list[int] | None, token_ids: list[int] | None, version: str,
) -> None:  # fmt: skip
    incomplete = finish_reason == "length"
    response["status"] = "incomplete" if incomplete else "completed"
    response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
    response["usage"] = {
        "input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out,
    }  # fmt: skip
    response["model_version"] = version
    if prompt_ids is not None:
        response["prompt_token_ids"] = prompt_ids
    if token_ids is not None:
        response["token_ids"] = token_ids


def response_body(chat: dict[str, Any], call: Call, request: dict[str, Any]) -> dict[str, Any]:
    """A non-streaming Responses body from the backend's chat body."""
    choice = first_choice(chat)
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    calls = ToolCalls()
    calls.add_message(message.get("tool_calls"))
    logprobs = _logprobs(logprob_tokens(choice)) if _wants_logprobs(request) else None
    response = envelope(request, call, _id("resp_"), int(time.time()), "completed")
    output: list[dict[str, Any]] = []
    if text or not calls.all():
        output.append(_message(_id("msg_"), "completed", [_text_part(text, logprobs)]))
    output.extend(_function_call(c, "completed") for c in calls.all())
    response["output"] = output
    n_in, n_out = usage_of(chat, None)
    prompt_ids, token_ids = chat.get("prompt_token_ids"), choice.get("token_ids")
    _finish(response, choice.get("finish_reason"), n_in, n_out, prompt_ids, token_ids,
            str(chat.get("model_version") or ""))  # fmt: skip
    return response


class ResponsesEncoder(StreamedChat):
    """One streaming call's chat chunks as Responses events (`fulmen_llm_proxy.api.dialects.Encoder`)."""

    def __init__(self, call: Call, request: dict[str, Any]) -> None:
        super().__init__()
        self.call, self.request = call, request
        self.response = envelope(request, call, _id("resp_"), int(time.time()), "in_progress")
        self.sequence = 0
        self.message_id = _id("msg_")
        self.opened = False
        self.logprobs: list[dict[str, Any]] | None = [] if _wants_logprobs(request) else None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        out = []
        if self.sequence == 0:
            out.append(self._event("response.created", response=self.response))
            out.append(self._event("response.in_progress", response=self.response))
        choice, text = self.read(chunk)
        if text:
            if not self.opened:
                out.append(self._open())
            logprobs = None
            if self.logprobs is not None:
                logprobs = _logprobs(logprob_tokens(choice))
                self.logprobs.extend(logprobs)
            out.append(self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                   content_index=0, delta=text, logprobs=logprobs or []))  # fmt: skip
        return b"".join(out)

    def _open(self) -> bytes:
        self.opened = True
        return self._event(
            "response.output_item.added", output_index=0, item=_message(self.message_id, "in_progress", [])
        ) + self._event("response.content_part.added", item_id=self.message_id, output_index=0,
                        content_index=0, part=_text_part("", [] if self.logprobs is not None else None))  # fmt: skip

    def end(self, result: Result) -> bytes:
        out = [self.chunk({})] if self.sequence == 0 else []
        output: list[dict[str, Any]] = []
        calls = self.calls.all()
        if self.opened or not calls:
            if not self.opened:
                out.append(self._open())
            text = "".join(self.texts)
            part = _text_part(text, self.logprobs)
            out.append(self._event("response.output_text.done", item_id=self.message_id, output_index=0,
                                   content_index=0, text=text, logprobs=self.logprobs or []))  # fmt: skip
            out.append(self._event("response.content_part.done", item_id=self.message_id, output_index=0,
                                   content_index=0, part=part))  # fmt: skip
            item = _message(self.message_id, "completed", [part])
            out.append(self._event("response.output_item.done", output_index=0, item=item))
            output.append(item)
        for call in calls:
            index, item = len(output), _function_call(call, "completed")
            added = _function_call(call, "in_progress", arguments="")
            out.append(self._event("response.output_item.added", output_index=index, item=added))
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=index, delta=call["arguments"]))  # fmt: skip
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, name=call["name"], arguments=call["arguments"]))  # fmt: skip
            out.append(self._event("response.output_item.done", output_index=index, item=item))
            output.append(item)
        response = self.response
        response["output"] = output
        n_in, n_out = usage_of({"usage": self.usage}, result)
        _finish(response, result.finish_reason or self.finish_reason, n_in, n_out, self.prompt_ids,
                self.token_ids, result.model_version or self.version)  # fmt: skip
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=response))
        return b"".join(out)

    def error(self, error: ProxyError) -> bytes:
        # The openai client raises an event whose data holds an "error" object.
        body = json.loads(error.body())["error"]
        return self._event("error", code=body["code"], message=body["message"], param=body["param"], error=body)
