"""The ``openai`` backend: any OpenAI-compatible upstream server, text only.

Its spans are ``text_only``: fine for prompt optimisation and SFT, not for RL. Retries, rate limits
and the cache: `fulmen_llm_proxy.backends.upstream.policy`; why only text-only backends cache: docs/design/proxy.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fulmen_llm_proxy.api import json_body
from fulmen_llm_proxy.backends.base import BASE_MODEL_VERSION, Call, Fidelity, Result
from fulmen_llm_proxy.backends.upstream.cache import request_key
from fulmen_llm_proxy.backends.upstream.policy import UpstreamPolicy
from fulmen_llm_proxy.backends.upstream.rate_limit import estimate_tokens
from fulmen_llm_proxy.backends.upstream.upstreams import Payload, Upstreams
from fulmen_llm_proxy.errors import bad_request

_PATHS = {"chat": "/v1/chat/completions", "text_completion": "/v1/completions"}


class OpenAIBackend:
    system = "openai"
    fidelity: Fidelity = "text_only"
    # its answers are the upstream's JSON as `json_body.loads` read it: `json_body.dumps` writes them
    parsed_answers = True

    def __init__(
        self, urls: list[str], *, model_name: str | None = None, api_key: str | None = None,
        policy: UpstreamPolicy | None = None,
    ) -> None:  # fmt: skip
        self.upstreams = Upstreams(urls, api_key, policy=policy)
        self._names = [model_name] if model_name else []

    @property
    def model_names(self) -> list[str]:
        return self._names

    @property
    def model_version(self) -> str:
        return BASE_MODEL_VERSION  # the upstream loads its own weights; it may say otherwise per response

    async def start(self) -> None:
        await self.upstreams.start()

    async def close(self) -> None:
        await self.upstreams.close()

    def ready(self) -> bool:
        return True

    async def load_weights(
        self, state_dict: dict[str, Any], model_version: str, weights_format: Mapping[str, Any] | None = None
    ) -> bool:
        return False

    def current_weights(self) -> Mapping[str, Any] | None:
        return None

    def payload(self, call: Call) -> dict[str, Any]:
        """The body sent upstream (the vllm backend asks for token ids here)."""
        return call.body

    def encode(self, call: Call) -> Payload:
        """The bytes sent upstream, or a function of the replica's base URL giving them."""
        return json_body.dumps(self.payload(call))

    async def complete(self, call: Call, result: Result) -> dict[str, Any]:
        return await self._complete(call, result)

    def _check(self, call: Call) -> None:
        if call.n > 1 and self.fidelity == "exact":
            # one span holds one choice's token ids: the others would be served and never trained on
            raise bad_request("n > 1 is served by the torch backend only; send n calls", "n")

    async def _complete(self, call: Call, result: Result, on_send: Callable[[str], None] | None = None) -> dict[str, Any]:
        self._check(call)
        payload = self.encode(call)
        path = _PATHS[call.operation]
        caching = self.fidelity == "text_only" and self.upstreams.cache is not None
        key = request_key(path, call.body) if caching else None
        body = await self.upstreams.post_json(
            path, payload, call.rollout_id, on_send, cost=estimate_tokens(_sized(payload), call.max_tokens, call.n),
            cache_key=key,
        )  # fmt: skip
        self.read_response(call, body, result)
        return body

    def stream(self, call: Call, result: Result) -> AsyncIterator[dict[str, Any]]:
        return self._stream(call, result)

    async def _stream(self, call: Call, result: Result,
                      on_send: Callable[[str], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        self._check(call)
        payload = self.encode(call)
        parts: list[str] = []
        tools: dict[int, dict[str, Any]] = {}
        result.fidelity = self.fidelity
        result.model_version = self.model_version
        cost = estimate_tokens(_sized(payload), call.max_tokens, call.n)
        async for chunk in self.upstreams.post_sse(_PATHS[call.operation], payload, call.rollout_id, on_send, cost=cost):
            self.read_header(chunk, result)
            for choice in chunk.get("choices") or ():
                self.read_stream_choice(call, choice, result, parts, tools)
            yield chunk
        result.text = "".join(parts)
        if tools:
            result.tool_calls = [tools[i] for i in sorted(tools)]

    # --- reading responses ------------------------------------------------------------------------

    def read_header(self, body: dict[str, Any], result: Result) -> None:
        result.response_id = body.get("id") or result.response_id
        result.response_model = body.get("model") or result.response_model
        result.model_version = str(body.get("model_version") or result.model_version or self.model_version)
        usage = body.get("usage")
        if isinstance(usage, dict):
            result.input_tokens = usage.get("prompt_tokens")
            result.output_tokens = usage.get("completion_tokens")

    def read_response(self, call: Call, body: dict[str, Any], result: Result) -> None:
        result.fidelity = self.fidelity
        self.read_header(body, result)
        read_choice(call, (body.get("choices") or [{}])[0], result)

    def read_stream_choice(
        self,
        call: Call,
        choice: dict[str, Any],
        result: Result,
        parts: list[str],
        tools: dict[int, dict[str, Any]],
    ) -> None:
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
        if call.operation != "chat":
            parts.append(choice.get("text") or "")
            return
        delta = choice.get("delta") or {}
        if delta.get("content"):
            parts.append(delta["content"])
        for tool_delta in delta.get("tool_calls") or ():
            # Tool calls stream in pieces: the first names the call, later ones extend its arguments.
            index = tool_delta.get("index", 0)
            tool = tools.setdefault(
                index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            tool["id"] = tool_delta.get("id") or tool["id"]
            function = tool_delta.get("function") or {}
            tool["function"]["name"] += function.get("name") or ""
            tool["function"]["arguments"] += function.get("arguments") or ""


def _sized(payload: Payload) -> bytes:
    """The body whose size estimates a call's tokens (any replica's: they differ in the model name)."""
    return payload if isinstance(payload, bytes) else payload("")


def read_choice(call: Call, choice: dict[str, Any], result: Result) -> None:
    """One choice of an answer: its finish reason, its text (and a chat's tool calls)."""
    result.finish_reason = choice.get("finish_reason")
    if call.operation == "chat":
        message = choice.get("message") or {}
        result.text = message.get("content") or ""
        result.tool_calls = message.get("tool_calls") or None
    else:
        result.text = choice.get("text") or ""
