"""The torch backend's choices: ``n`` samples of one prompt, each an OpenAI choice and a span of its own.

Seeds, usage and streaming: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fulmen_llm_proxy.api import formatting
from fulmen_llm_proxy.backends import tool_calls
from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.backends.tool_calls import ToolPlan

Step = tuple[str, int, float]  # new text, token id, logprob
Generate = Callable[[Call, Result, list[int], int], AsyncIterator[Step]]


def choice_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else seed + index


def apply_tools(result: Result, tools: ToolPlan) -> str | None:
    """Parse the choice's text into content and tool calls (in ``result``); why it holds no tool
    calls when it tried to or had to (None otherwise)."""
    parsed = tool_calls.parse(result.text, tools)
    result.text = parsed.content or ""
    result.tool_calls = parsed.tool_calls or None
    if parsed.tool_calls:
        result.finish_reason = "tool_calls"
    return parsed.error


def full_body(backend: Any, call: Call, choices: list[Result]) -> dict[str, Any]:
    """The non-streaming response with one choice per Result."""
    body: dict[str, Any] = {}
    out: list[dict[str, Any]] = []
    for index, result in enumerate(choices):
        ids = result.token_ids or []
        one = formatting.full_body(
            call, result.response_id, prompt_ids=result.prompt_token_ids or [], token_ids=ids,
            tokens=backend.token_strings(call, ids), logprobs=result.logprobs or [], text=result.text,
            finish_reason=result.finish_reason or "length",
        )  # fmt: skip
        choice = one["choices"][0]
        choice["index"] = index
        if result.tool_calls:
            choice["message"]["tool_calls"] = result.tool_calls
            choice["message"]["content"] = result.text or None
        _tool_error(choice, result)
        body = body or one
        out.append(choice)
    body["choices"] = out
    body["usage"] = formatting.usage(len(choices[0].prompt_token_ids or []), sum(len(r.token_ids or []) for r in choices))
    return body


def as_choice(body: dict[str, Any], index: int, first: bool) -> dict[str, Any]:
    """A chunk of choice ``index`` (its first carries the role)."""
    choice = body["choices"][0]
    choice["index"] = index
    if first and "delta" in choice:
        choice["delta"]["role"] = "assistant"
    return body


def final_chunks(body: dict[str, Any], delta: dict[str, Any], result: Result) -> list[dict[str, Any]]:
    """A choice's last chunks: its held-back content and tool calls (when any), then its finish reason
    in a chunk of its own, as OpenAI sends them. ``body`` is the finish chunk."""
    chunks = []
    choice = body["choices"][0]
    if delta:
        before = {**body, "choices": [{**choice, "finish_reason": None, "delta": {**choice["delta"], **delta}}]}
        chunks.append(before)
    if "delta" in choice:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if k == "role"} | {"content": ""}
    _tool_error(choice, result)
    chunks.append(body)
    return chunks


def _tool_error(choice: dict[str, Any], result: Result) -> None:
    error = result.extra.get("tool_error")
    if error:
        choice["fulmen_tool_error"] = error


async def merged(generate: Generate, call: Call, choices: list[Result], prompt: list[int]
                 ) -> AsyncIterator[tuple[int, Step]]:
    """The steps of every choice as they come, each with its choice's index; an error in one ends
    them all (the others are cancelled, their engine requests with them)."""
    if len(choices) == 1:
        async for step in generate(call, choices[0], prompt, 0):
            yield 0, step
        return
    queue: asyncio.Queue[tuple[int, Step | BaseException | None]] = asyncio.Queue()

    async def run(index: int) -> None:
        try:
            async for step in generate(call, choices[index], prompt, index):
                queue.put_nowait((index, step))
        except Exception as e:
            queue.put_nowait((index, e))
            return
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(run(i)) for i in range(len(choices))]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
