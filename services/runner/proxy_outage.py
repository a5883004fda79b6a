"""An attempt whose LLM proxy could not be reached: wait for the proxy, then run the rollout again.

The infrastructure failed, not the agent: the runner holds the attempt (heartbeating) while it probes
the proxy's /readyz with jittered backoff, hands the attempt back once the proxy answers (a hand-back
leaves max_attempts untouched), and fails the rollout, naming the proxy, once it has waited
``proxy_retry_s`` since the rollout first found the proxy unreachable. Why: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai

from fulmen import keys as k
from fulmen.errors import NotFound
from fulmen.records import AttemptedRollout
from fulmen.store import RedisStore

log = logging.getLogger(__name__)

FIRST_PROBE_S = 0.5  # the first wait before probing the proxy again; it doubles, with jitter
MAX_PROBE_S = 5.0  # never longer between probes: a proxy back at once costs the rollout little
PROBE_TIMEOUT_S = 2.0
ERROR_TYPE = "ProxyUnreachable"  # the `type` of the error a hand-back for this reason stores
SINCE = "unreachable_since"  # its key for when the rollout first found the proxy unreachable (epoch s)


# The codes of a Fulmen proxy's own 503s: it runs but cannot serve now (it waits for a model version
# Redis lost, it shuts down, its upstream replicas reload, its engine stopped). Another 503 (an
# upstream's, passed through) stays the agent's failure.
UNAVAILABLE_CODES = frozenset({"waiting_for_version", "shutting_down", "upstream_loading", "engine_closed"})


class ProxyUnreachable(Exception):
    """The agent's LLM call never reached the proxy, the proxy went away mid-call, or it answered that
    it cannot serve now (a 503 of its own, `UNAVAILABLE_CODES`)."""

    def __init__(self, message: str, base_url: str) -> None:
        super().__init__(message)
        self.base_url = base_url


def proxy_unreachable(error: BaseException | None) -> ProxyUnreachable | None:
    """The real cause when ``error`` is (or was raised from) the openai client failing to reach its
    server — it says APITimeoutError or "Connection error." where the cause is a refused connection."""
    chain: list[BaseException] = []
    e = error
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    found = next((c for c in chain if isinstance(c, openai.APIConnectionError)), None)
    if found is None:
        return _unavailable(chain)
    root = chain[-1]
    url = getattr(getattr(found, "request", None), "url", "")
    base = str(url).split("/rollout/")[0].split("/v1/")[0] if url else ""
    cause = f"{type(root).__name__}: {root}" if root is not found else type(found).__name__
    return ProxyUnreachable(f"proxy {base or 'the LLM endpoint'} unreachable ({cause})", base)


def _unavailable(chain: list[BaseException]) -> ProxyUnreachable | None:
    """A 503 the proxy answered for itself, from any client that keeps the status and the JSON body
    (openai's and anthropic's APIStatusError do)."""
    for e in chain:
        if getattr(e, "status_code", None) != 503:
            continue
        body = getattr(e, "body", None)
        error = body.get("error", body) if isinstance(body, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        if code in UNAVAILABLE_CODES:
            url = str(getattr(getattr(e, "request", None), "url", "") or "")
            base = url.split("/rollout/")[0].split("/v1/")[0] if url else ""
            return ProxyUnreachable(f"proxy {base or 'the LLM endpoint'} unavailable ({code}: {error.get('message')})",
                                    base)
    return None


def error_record(unreachable: ProxyUnreachable, since: float, message: str | None = None) -> dict[str, Any]:
    """The error an attempt ended for ``unreachable`` stores: the next attempt reads ``since`` back."""
    return {"type": ERROR_TYPE, "message": message or str(unreachable), SINCE: since}


async def unreachable_since(store: RedisStore, claimed: AttemptedRollout) -> float:
    """When the rollout first found its proxy unreachable: the time the previous attempt recorded if it
    was handed back for that reason (the outage goes on), else now."""
    sequence = claimed.attempt.sequence_id
    if sequence > 1:
        try:
            previous = await store.rollouts.get_attempt(k.attempt_id(claimed.rollout.rollout_id, sequence - 1))
        except NotFound:
            return time.time()
        error = previous.error or {}
        if error.get("type") == ERROR_TYPE and isinstance(error.get(SINCE), int | float):
            return float(error[SINCE])
    return time.time()


async def ready(base_url: str) -> bool:
    """The proxy answers its /readyz (a server that is not a Fulmen proxy: any answer below 500)."""
    try:
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as client:
            reply = await client.get(f"{base_url}/readyz")
    except httpx.HTTPError:
        return False
    return reply.status_code < 500


async def wait_for_proxy(
    base_url: str, deadline: float, moved: Callable[[], Awaitable[bool]] | None = None
) -> bool:
    """Probe ``base_url`` with jittered exponential backoff until it is ready (True), ``moved`` says a
    new attempt would go to another proxy (True), or the clock (epoch s) passes ``deadline`` (False)."""
    delay = FIRST_PROBE_S
    while True:
        left = deadline - time.time()
        if left <= 0:
            return False
        # full jitter over the upper half: runners that lost one proxy together do not probe in step
        await asyncio.sleep(min(left, random.uniform(delay / 2, delay) if base_url else MAX_PROBE_S))
        if not base_url:  # nothing to probe: run the rollout again after the longest wait
            return True
        if await ready(base_url) or (moved is not None and await moved()):
            return True
        delay = min(delay * 2, MAX_PROBE_S)
