"""The judge's OpenAI client, from the agent's `fulmen.LLM`, any OpenAI client, or the environment.

The judge's calls keep the attempt's attribution (the ``/rollout/{r}/attempt/{a}`` prefix, the
``x-fulmen-*`` headers), so a proxy stores them with the rollout and its trace shows them, and each
carries ``x-fulmen-purpose: judge`` (`JUDGE_HEADER`): the proxy copies it into the call's span
(`semconv.CALL_PURPOSE`) and the adapter never turns such a call into a sample (it counts it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fulmen.errors import InvalidInput
from fulmen.telemetry import semconv

JUDGE_HEADER = semconv.HEADER_PURPOSE
JUDGE_PURPOSE = semconv.PURPOSE_JUDGE
_MARK = {JUDGE_HEADER: JUDGE_PURPOSE}


@dataclass
class JudgeClient:
    client: Any  # an openai.AsyncOpenAI (or OpenAI) client
    model: str
    owned: bool  # made here: closed after the judge's call

    async def close(self) -> None:
        if self.owned:
            await self.client.close()


def judge_client(client: Any, model: str | None) -> JudgeClient:
    """The client and model for the judge's calls (see the module's docstring)."""
    import openai

    from fulmen.sdk.resources import LLM  # here: importing the SDK costs the import of OpenTelemetry

    if client is None:
        if not model:
            raise InvalidInput("judge: give model= (the judge's model) when no client is given")
        return JudgeClient(openai.AsyncOpenAI(default_headers=_MARK), model, owned=True)
    if isinstance(client, LLM):
        # the attempt's own client, marked: its base URL and headers attribute the call, and its HTTP
        # pool (the process's) carries the trace context, so the call's span sits under the judge's
        return JudgeClient(client.async_client.copy(default_headers=_MARK), model or client.model, owned=False)
    if not hasattr(client, "chat") or not hasattr(client, "copy"):
        raise InvalidInput(f"judge: client must be a fulmen.LLM or an OpenAI client, got {type(client).__name__}")
    if not model:
        raise InvalidInput("judge: give model= (the judge's model) with an OpenAI client")
    # copy's default_headers add to the headers its maker gave it; it shares the caller's connection pool
    return JudgeClient(client.copy(default_headers=_MARK), model, owned=False)
