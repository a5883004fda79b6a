"""The ``vllm`` backend: a vLLM OpenAI-compatible server, asked for token ids and log-probabilities.

Calls go only to ready replicas (`fulmen_llm_proxy.backends.upstream.replicas`); a call that may have met two sets of
weights is sent again or recorded ``text_only``. The fields and why: docs/design/proxy.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fulmen.records import ReplicaState
from fulmen.serving.ab import arm_of
from fulmen_llm_proxy.api import json_body
from fulmen_llm_proxy.backends import tool_calls
from fulmen_llm_proxy.backends.base import Call, Fidelity, Result
from fulmen_llm_proxy.backends.upstream.openai import OpenAIBackend, read_choice
from fulmen_llm_proxy.backends.upstream.replicas import ReplicaView, Stamp
from fulmen_llm_proxy.backends.upstream.upstreams import Payload
from fulmen_llm_proxy.errors import ProxyError, bad_request

log = logging.getLogger(__name__)

MIN_SENDS = 2  # a call the replica's weights changed under is sent again at least once


class VllmBackend(OpenAIBackend):
    system = "vllm"
    fidelity: Fidelity = "exact"
    replicas: ReplicaView | None = None

    @staticmethod
    def _arm_b(call: Call, state: ReplicaState | None) -> bool:
        """Whether a call goes to the A/B test's B on this replica: it serves B (its state says so, with
        the split) and `fulmen.serving.ab.arm_of` gives the call's rollout to B."""
        return state is not None and bool(state.b_version) and arm_of(call.rollout_id, state.b_split) == "b"

    def _served(self, call: Call, stamp: Stamp, version: str) -> str:
        """The version a call confirmed under ``stamp`` got: B's when it went to B."""
        return stamp.state.b_version if self._arm_b(call, stamp.state) and stamp.state is not None else version

    def follow_replicas(self, view: ReplicaView) -> None:
        self.replicas = view
        self.upstreams.routable = view.routable

    async def complete(self, call: Call, result: Result) -> dict[str, Any]:
        view = self.replicas
        if view is None:
            return await self._complete(call, result)
        # a call the replica's weights changed under is sent again, once its replicas are ready (the
        # view read again first: the reload that spoiled it is still under way), until the load wait ends
        deadline = time.monotonic() + self.upstreams.policy.load_wait_s
        for send in itertools.count(1):
            stamps: list[Stamp] = []
            body = await self._complete(call, result, stamps_into(stamps, view))
            version = await view.confirm(stamps[-1])
            if version is not None:
                version = self._served(call, stamps[-1], version)
                for choice in (result, *result.more):
                    choice.model_version = version or choice.model_version
                return body
            if send >= MIN_SENDS and time.monotonic() >= deadline:
                break
            log.info("the replica %s changed weights during a call: sending it again", stamps[-1].url)
            await view.refresh()
        raise ProxyError(503, "the upstream replica changed weights during every send of the call: retry it",
                         code="upstream_loading")

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

    def encode(self, call: Call) -> Payload:
        view = self.replicas
        plain = json_body.dumps(self.payload(call))
        if view is None:
            return plain

        def for_replica(url: str) -> bytes:
            state = view.states.get(url)
            if self._arm_b(call, state):
                return json_body.dumps({**self.payload(call), "model": state.b_version})  # type: ignore[union-attr]
            if state is None or not state.served_model:
                return plain
            return json_body.dumps({**self.payload(call), "model": state.served_model})

        return for_replica

    def _check(self, call: Call) -> None:
        # n > 1 in one answer: every choice carries its own token ids. Streamed, the choices' chunks
        # would have to be told apart as they come: not done here
        if call.n > 1 and call.stream:
            raise bad_request("n > 1 is not streamed on the vllm backend: send stream: false, or n calls", "n")

    def read_response(self, call: Call, body: dict[str, Any], result: Result) -> None:
        super().read_response(call, body, result)
        choices = body.get("choices") or [{}]
        prompt_ids = body.get("prompt_token_ids") or choices[0].get("prompt_token_ids")
        result.more = [dataclasses.replace(result, more=[], extra={}) for _ in choices[1:]]
        for index, (choice, into) in enumerate(zip(choices, [result, *result.more], strict=True)):
            if index:  # choice 0 was read by the OpenAI backend; the others the same way
                read_choice(call, choice, into)
            token_ids = choice.get("token_ids")
            if prompt_ids is None or token_ids is None:
                into.fidelity = "text_only"
                continue
            into.prompt_token_ids = list(prompt_ids)
            into.token_ids = list(token_ids)
            into.logprobs = _logprobs(call, choice.get("logprobs"))
        if call.operation == "chat":
            check_tool_calls(call, choices, [result, *result.more])

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

    async def stream(self, call: Call, result: Result) -> AsyncIterator[dict[str, Any]]:  # type: ignore[override]
        view = self.replicas
        stamps: list[Stamp] = []
        on_send = None if view is None else stamps_into(stamps, view)
        async for chunk in self._stream(call, result, on_send):
            yield chunk
        if result.prompt_token_ids is None or result.token_ids is None:
            result.fidelity = "text_only"
        if view is not None and stamps:
            version = await view.confirm(stamps[-1])
            if version is None:  # already answered: keep the text, never train on its token ids
                log.info("the replica %s changed weights during a streamed call: recorded as text only",
                         stamps[-1].url)
                result.fidelity = "text_only"
            elif version:
                result.model_version = self._served(call, stamps[-1], version)


def check_tool_calls(call: Call, choices: list[dict[str, Any]], results: list[Result]) -> None:
    """The tool calls vLLM's parser found, held to the request's tools as the torch backend holds its
    own: a call that breaks them (an unknown tool, arguments its schema refuses, tool_choice unmet)
    comes back as plain content, the calls written as the model wrote them, with ``fulmen_tool_error``
    saying why; the span records the same."""
    try:
        tools = tool_calls.plan(call.body)
    except ProxyError:
        return  # tools this proxy would refuse, which vLLM took: its answer stands
    if tools is None:
        return
    for choice, result in zip(choices, results, strict=True):
        message = choice.get("message") or {}
        calls = message.get("tool_calls") or []
        problem = tool_calls.check_calls(calls, tools) if calls or tools.required is not None else None
        if problem is None:
            continue
        text = (message.get("content") or "") + tool_calls.as_text(calls)
        message["content"], message["tool_calls"] = text, []
        choice["message"], choice["finish_reason"], choice["fulmen_tool_error"] = message, "stop", problem
        result.text, result.tool_calls, result.finish_reason = text, None, "stop"
        result.extra["tool_error"] = problem


def stamps_into(stamps: list[Stamp], view: ReplicaView) -> Callable[[str], None]:
    """An ``on_send`` that keeps the replica's state as the call leaves for it."""
    return lambda url: stamps.append(view.stamp(url))


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
