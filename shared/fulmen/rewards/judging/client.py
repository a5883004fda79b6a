"""The judge's OpenAI client, from the agent's `fulmen.LLM`, any OpenAI client, or the environment.

Its calls must never become training samples: the proxy stores only calls attributed to an attempt
(the ``/rollout/{r}/attempt/{a}`` prefix or the ``x-fulmen-*`` headers) and the adapter samples only
stored calls, so the judge's client is the agent's without that attribution. Each call also carries
``x-fulmen-purpose: judge`` (`JUDGE_HEADER`), so a judge call is recognisable wherever it goes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fulmen.errors import InvalidInput
from fulmen.telemetry import semconv

JUDGE_HEADER = "x-fulmen-purpose"
JUDGE_PURPOSE = "judge"
_ATTEMPT_PATH = re.compile(r"/rollout/[^/]+/attempt/[^/]+(?=/|$)")
_ATTRIBUTION = frozenset({semconv.HEADER_ROLLOUT_ID, semconv.HEADER_ATTEMPT_ID})


@dataclass
class JudgeClient:
    client: Any  # an openai.AsyncOpenAI (or OpenAI) client
    model: str
    owned: bool  # made here: closed after the judge's call

    async def close(self) -> None:
        if self.owned:
            await self.client.close()


def unattributed(base_url: str) -> str:
    """``base_url`` without an attempt's path prefix (the proxy's own ``/v1``)."""
    return _ATTEMPT_PATH.sub("", base_url.rstrip("/"), count=1)


def _headers(headers: dict[str, str]) -> dict[str, str]:
    kept = {k: v for k, v in headers.items() if k.lower() not in _ATTRIBUTION}
    return {**kept, JUDGE_HEADER: JUDGE_PURPOSE}


def judge_client(client: Any, model: str | None) -> JudgeClient:
    """The client and model for the judge's calls (see the module's docstring)."""
    import openai

    from fulmen.sdk.resources import LLM  # here: importing the SDK costs the import of OpenTelemetry

    if client is None:
        if not model:
            raise InvalidInput("judge: give model= (the judge's model) when no client is given")
        return JudgeClient(openai.AsyncOpenAI(default_headers=_headers({})), model, owned=True)
    if isinstance(client, LLM):
        made = openai.AsyncOpenAI(base_url=unattributed(client.base_url), api_key=client.api_key,
                                  default_headers=_headers(dict(client.headers)))
        return JudgeClient(made, model or client.model, owned=True)
    if not hasattr(client, "chat") or not hasattr(client, "copy"):
        raise InvalidInput(f"judge: client must be a fulmen.LLM or an OpenAI client, got {type(client).__name__}")
    if not model:
        raise InvalidInput("judge: give model= (the judge's model) with an OpenAI client")
    custom = dict(getattr(client, "_custom_headers", None) or {})  # the headers its maker gave it
    copy = client.copy(base_url=unattributed(str(client.base_url)), set_default_headers=_headers(custom))
    return JudgeClient(copy, model, owned=False)  # shares the caller's connection pool: left open
