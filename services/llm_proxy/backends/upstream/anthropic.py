"""The ``anthropic`` backend: an Anthropic-compatible upstream's ``POST /v1/messages``, text only.

What maps to what: `fulmen_llm_proxy.backends.upstream.anthropic_translate`; retries, rate limits and caching:
`fulmen_llm_proxy.backends.upstream.policy`. Why: docs/design/proxy.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.backends.upstream.anthropic_translate import (
    ANTHROPIC_VERSION,
    chat_body,
    chat_usage,
    finish_reason,
    messages_request,
    tool_call,
    unknown_block,
)
from fulmen_llm_proxy.backends.upstream.cache import request_key
from fulmen_llm_proxy.backends.upstream.openai import OpenAIBackend
from fulmen_llm_proxy.backends.upstream.policy import UpstreamPolicy
from fulmen_llm_proxy.backends.upstream.rate_limit import estimate_tokens
from fulmen_llm_proxy.backends.upstream.upstreams import Upstreams
from fulmen_llm_proxy.errors import ProxyError, bad_request

PATH = "/v1/messages"
DEFAULT_MAX_TOKENS = 4096


class AnthropicBackend(OpenAIBackend):
    system = "anthropic"

    def __init__(
        self, urls: list[str], *, model_name: str | None = None, api_key: str | None = None,
        policy: UpstreamPolicy | None = None, default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:  # fmt: skip
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        self.upstreams = Upstreams(urls, policy=policy, headers=headers)
        self._names = [model_name] if model_name else []
        self.default_max_tokens = default_max_tokens

    def request(self, call: Call) -> dict[str, Any]:
        if call.operation != "chat":
            raise bad_request(
                "the anthropic backend serves chat calls only (Anthropic has no completions API): "
                "use /v1/chat/completions or /v1/messages", "prompt", "unsupported_operation",
            )  # fmt: skip
        return messages_request(call, self.default_max_tokens)

    async def _complete(self, call: Call, result: Result, on_send: Callable[[str], None] | None = None) -> dict[str, Any]:
        request = self.request(call)
        payload = json.dumps(request).encode()
        key = request_key(PATH, request, {}) if self.upstreams.cache is not None else None
        answer = await self.upstreams.post_json(
            PATH, payload, call.rollout_id, on_send, cost=estimate_tokens(payload, request["max_tokens"]),
            cache_key=key,
        )  # fmt: skip
        body = chat_body(answer, call.model)
        self.read_response(call, body, result)
        return body

    async def _stream(self, call: Call, result: Result,
                      on_send: Callable[[str], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        request = self.request(call)
        payload = json.dumps(request).encode()
        parts: list[str] = []
        tools: dict[int, dict[str, Any]] = {}
        result.fidelity = self.fidelity
        result.model_version = self.model_version
        chunks = ChatChunks(call)
        events = self.upstreams.post_sse(
            PATH, payload, call.rollout_id, on_send, cost=estimate_tokens(payload, request["max_tokens"])
        )
        async for event in events:
            for chunk in chunks.read(event):
                self.read_header(chunk, result)
                for choice in chunk["choices"]:
                    self.read_stream_choice(call, choice, result, parts, tools)
                yield chunk
        if not chunks.stopped:
            raise ProxyError(502, "the Anthropic upstream's stream ended before message_stop", code="upstream_error")
        result.text = "".join(parts)
        if tools:
            result.tool_calls = [tools[i] for i in sorted(tools)]
        usage = chat_usage(chunks.usage)
        if usage is not None:
            result.input_tokens, result.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]


class ChatChunks:
    """One call's Messages stream events as chat chunks (``read`` per event)."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.base: dict[str, Any] = {"id": "", "object": "chat.completion.chunk", "created": int(time.time()),
                                     "model": call.model}  # fmt: skip
        self.usage: dict[str, Any] = {}
        self.tools: dict[int, int] = {}  # content block index -> tool call index
        self.arguments: dict[int, bool] = {}  # tool call index -> some arguments came
        self.skipped: set[int] = set()  # thinking blocks
        self.stopped = False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    def read(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            self.base["id"] = str(message.get("id") or "")
            self.base["model"] = str(message.get("model") or self.call.model)
            self.usage.update(message.get("usage") or {})
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            return self._block_start(event.get("index"), event.get("content_block") or {})
        if kind == "content_block_delta":
            return self._block_delta(event.get("index"), event.get("delta") or {})
        if kind == "content_block_stop":
            tool = self.tools.get(event.get("index"))  # type: ignore[arg-type]
            if tool is not None and not self.arguments.get(tool):
                # a call without input streams no input_json_delta: its arguments are an empty object
                return [self._chunk({"tool_calls": [{"index": tool, "function": {"arguments": "{}"}}]})]
            return []
        if kind == "message_delta":
            self.usage.update(event.get("usage") or {})
            reason = finish_reason((event.get("delta") or {}).get("stop_reason"))
            return [self._chunk({}, reason or "stop")]
        if kind == "message_stop":
            self.stopped = True
            usage = chat_usage(self.usage)
            if self.call.include_usage and usage is not None:
                return [{**self.base, "choices": [], "usage": usage}]
            return []
        return []  # ping, and events added to the API later

    def _block_start(self, index: Any, block: dict[str, Any]) -> list[dict[str, Any]]:
        kind = block.get("type")
        if kind == "text":
            return [self._chunk({"content": block["text"]})] if block.get("text") else []
        if kind == "tool_use":
            tool = self.tools[index] = len(self.tools)
            call = tool_call({**block, "input": {}})
            call["function"]["arguments"] = ""
            if block.get("input"):  # input given whole at the start (not Anthropic's way, but valid)
                call["function"]["arguments"] = json.dumps(block["input"], ensure_ascii=False)
                self.arguments[tool] = True
            return [self._chunk({"tool_calls": [{"index": tool, **call}]})]
        if kind in ("thinking", "redacted_thinking"):
            self.skipped.add(index)
            return []
        raise unknown_block(kind)

    def _block_delta(self, index: Any, delta: dict[str, Any]) -> list[dict[str, Any]]:
        kind = delta.get("type")
        if kind == "text_delta" and delta.get("text"):
            return [self._chunk({"content": str(delta["text"])})]
        if kind == "input_json_delta" and index in self.tools and delta.get("partial_json"):
            tool = self.tools[index]
            self.arguments[tool] = True
            piece = {"index": tool, "function": {"arguments": str(delta["partial_json"])}}
            return [self._chunk({"tool_calls": [piece]})]
        return []  # thinking, signature and citation deltas: nothing of the chat answer
