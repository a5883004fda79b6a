"""The ``vllm`` backend: a vLLM OpenAI-compatible server, asked for token ids and log-probabilities.

Each request goes upstream with ``return_token_ids: true`` and ``logprobs`` switched on, and the
response comes back in vLLM's own shape, which is the proxy's shape too:

- chat: ``prompt_token_ids`` at the top level, ``token_ids`` in each choice,
  ``choices[i].logprobs.content[*].logprob``;
- ``/v1/completions``: ``prompt_token_ids`` and ``token_ids`` in each choice,
  ``logprobs.token_logprobs``;
- streaming: the same fields per chunk (``prompt_token_ids`` in the first, the chunk's
  ``token_ids`` in each).

A vLLM too old to know ``return_token_ids`` leaves the ids out: the call is then recorded as
``text_only`` rather than with made-up ids.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fulmen_llm_proxy.backend_base import Call, Fidelity, Result
from fulmen_llm_proxy.backend_openai import OpenAIBackend


class VllmBackend(OpenAIBackend):
    system = "vllm"
    fidelity: Fidelity = "exact"

    def payload(self, call: Call) -> dict[str, Any]:
        body = dict(call.body)
        body["return_token_ids"] = True
        if call.operation == "chat":
            body["logprobs"] = True
        elif not isinstance(body.get("logprobs"), int):
            body["logprobs"] = 0  # vLLM: the sampled token's log-probability, no alternatives
        if call.stream and not call.include_usage:
            # Usage (token counts) for the span; the extra last chunk is passed on to the agent too,
            # which OpenAI clients accept (choices = []).
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return body

    def read_response(self, call: Call, body: dict[str, Any], result: Result) -> None:
        super().read_response(call, body, result)
        choice = (body.get("choices") or [{}])[0]
        prompt_ids = body.get("prompt_token_ids") or choice.get("prompt_token_ids")
        token_ids = choice.get("token_ids")
        if prompt_ids is None or token_ids is None:
            result.fidelity = "text_only"
            return
        result.prompt_token_ids = list(prompt_ids)
        result.token_ids = list(token_ids)
        result.logprobs = _logprobs(call, choice.get("logprobs"))

    def read_stream_choice(
        self,
        call: Call,
        choice: dict[str, Any],
        result: Result,
        parts: list[str],
        tools: dict[int, dict[str, Any]],
    ) -> None:
        super().read_stream_choice(call, choice, result, parts, tools)
        if choice.get("prompt_token_ids") is not None:
            result.prompt_token_ids = list(choice["prompt_token_ids"])
        token_ids = choice.get("token_ids")
        if token_ids is not None:
            (result.token_ids if result.token_ids is not None else _set(result, "token_ids")).extend(
                token_ids
            )
        logprobs = _logprobs(call, choice.get("logprobs"))
        if logprobs is not None:
            (result.logprobs if result.logprobs is not None else _set(result, "logprobs")).extend(logprobs)

    def read_header(self, body: dict[str, Any], result: Result) -> None:
        super().read_header(body, result)
        if body.get("prompt_token_ids") is not None:
            result.prompt_token_ids = list(body["prompt_token_ids"])

    async def stream(self, call: Call, result: Result) -> AsyncIterator[dict[str, Any]]:
        async for chunk in super().stream(call, result):
            yield chunk
        if result.prompt_token_ids is None or result.token_ids is None:
            result.fidelity = "text_only"


def _set(result: Result, name: str) -> list[Any]:
    value: list[Any] = []
    setattr(result, name, value)
    return value


def _logprobs(call: Call, logprobs: Any) -> list[float] | None:
    if not isinstance(logprobs, dict):
        return None
    if call.operation == "chat":
        content = logprobs.get("content")
        return None if content is None else [float(item["logprob"]) for item in content]
    values = logprobs.get("token_logprobs")
    return None if values is None else [float(x) for x in values]
