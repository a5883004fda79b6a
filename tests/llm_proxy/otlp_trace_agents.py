"""The agent of the proxy's OTLP trace test (``otlp_trace_agents:two_calls``)."""

from __future__ import annotations

from typing import Any

import fulmen


@fulmen.rollout
async def two_calls(task: Any, llm: Any) -> float:
    """Two chat calls: one straight under the attempt's root span, one inside an operation span, so
    the test sees that each proxy span hangs under the runner span that was current at the call."""
    messages = [{"role": "user", "content": task["q"]}]
    await llm.async_client.chat.completions.create(model=llm.model, messages=messages, max_tokens=4)
    with fulmen.operation("second-turn"):
        await llm.async_client.chat.completions.create(model=llm.model, messages=messages, max_tokens=4)
    return 1.0
