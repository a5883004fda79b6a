"""OpenAI response bodies with vLLM's token-fidelity fields, for backends that produce tokens.

Field names follow vLLM (``return_token_ids``), so clients written for vLLM read the proxy as is.
The fields: docs/design/proxy.md.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fulmen_llm_proxy.backends.base import Call

RESPONSE_ID_HEX = 24  # random hex digits after the prefix: ids never repeat, as OpenAI's do not


def response_id(call: Call) -> str:
    return ("chatcmpl-" if call.operation == "chat" else "cmpl-") + uuid.uuid4().hex[:RESPONSE_ID_HEX]


def _object(call: Call, *, chunk: bool) -> str:
    """The body's ``object`` field: text completions use one name for bodies and chunks."""
    if call.operation != "chat":
        return "text_completion"
    return "chat.completion.chunk" if chunk else "chat.completion"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=True)
        ]
    }


def completion_logprobs(tokens: list[str], logprobs: list[float], offset: int = 0) -> dict[str, Any]:
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def full_body(
    call: Call,
    rid: str,
    *,
    prompt_ids: list[int],
    token_ids: list[int],
    tokens: list[str],
    logprobs: list[float],
    text: str,
    finish_reason: str,
) -> dict[str, Any]:
    """A non-streaming response."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "token_ids": token_ids}
    if call.operation == "chat":
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = chat_logprobs(tokens, logprobs)
    else:
        choice["text"] = text
        choice["logprobs"] = completion_logprobs(tokens, logprobs)
        choice["prompt_token_ids"] = prompt_ids
    return {
        "id": rid,
        "object": _object(call, chunk=False),
        "created": int(time.time()),
        "model": call.model,
        "choices": [choice],
        "usage": usage(len(prompt_ids), len(token_ids)),
        "prompt_token_ids": prompt_ids,
    }


@dataclass(frozen=True, slots=True)
class StreamHead:
    """What every chunk of one stream repeats: the call, the response id and when it was created."""

    call: Call
    rid: str
    created: int


def chunk(
    head: StreamHead,
    *,
    text: str,
    token_ids: list[int],
    tokens: list[str],
    logprobs: list[float],
    finish_reason: str | None = None,
    prompt_ids: list[int] | None = None,
    text_offset: int = 0,
) -> dict[str, Any]:
    """One streaming chunk; ``prompt_ids`` only in the first."""
    call = head.call
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "token_ids": token_ids}
    if call.operation == "chat":
        delta: dict[str, Any] = {"content": text}
        if prompt_ids is not None:
            delta["role"] = "assistant"
        choice["delta"] = delta
        choice["logprobs"] = chat_logprobs(tokens, logprobs) if tokens else None
    else:
        choice["text"] = text
        choice["logprobs"] = completion_logprobs(tokens, logprobs, text_offset) if tokens else None
        if prompt_ids is not None:
            choice["prompt_token_ids"] = prompt_ids
    body: dict[str, Any] = {
        "id": head.rid,
        "object": _object(call, chunk=True),
        "created": head.created,
        "model": call.model,
        "choices": [choice],
    }
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    return body


def usage_chunk(head: StreamHead, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
    return {
        "id": head.rid, "object": _object(head.call, chunk=True), "created": head.created, "model": head.call.model,
        "choices": [], "usage": usage(prompt_tokens, completion_tokens),
    }  # fmt: skip
