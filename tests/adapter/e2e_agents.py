"""The agent of the adapter's end-to-end test (``e2e_agents:chat_once``)."""

from __future__ import annotations

from typing import Any

import fulmen


@fulmen.rollout
async def chat_once(task: Any, llm: Any) -> float:
    """One chat call; records the token ids the proxy returned, so the test can compare the samples."""
    reply = await llm.async_client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=6, temperature=1.0
    )
    body = reply.model_dump()
    fulmen.emit_object(
        {"prompt_token_ids": body["prompt_token_ids"], "token_ids": body["choices"][0]["token_ids"]},
        returned="ids",
    )
    return 1.0 if reply.choices[0].message.content else 0.5
