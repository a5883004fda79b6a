"""How the proxy treats an upstream: retries with backoff, and the settings of the rate limit and cache.

Entry point `with_retries`. Which answers are retried, the backoff and the budget: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fulmen_llm_proxy.backends.upstream.deadlines import Deadlines
from fulmen_llm_proxy.errors import ProxyError

if TYPE_CHECKING:
    from fulmen.settings import ProxySettings

NOT_RETRIED_5XX = frozenset({501, 505})


@dataclass(frozen=True)
class UpstreamPolicy:
    max_attempts: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 20.0
    budget_s: float = 120.0
    timeout_s: float = 300.0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    cache_entries: int = 0
    load_wait_s: float = 120.0  # a call's wait while every replica loads a version

    @classmethod
    def from_settings(cls, settings: ProxySettings) -> UpstreamPolicy:
        return cls(
            max_attempts=settings.upstream_max_attempts, backoff_s=settings.upstream_backoff_s,
            backoff_max_s=settings.upstream_backoff_max_s, budget_s=settings.upstream_budget_s,
            timeout_s=settings.upstream_timeout_s, requests_per_minute=settings.upstream_rpm,
            tokens_per_minute=settings.upstream_tpm, cache_entries=settings.upstream_cache_entries,
            load_wait_s=settings.upstream_load_wait_s,
        )  # fmt: skip

    def backoff(self, retry: int, rng: random.Random | None = None) -> float:
        """The jittered wait before retry ``retry`` (1 for the first) when the upstream named none."""
        cap = min(self.backoff_max_s, self.backoff_s * 2 ** (retry - 1))
        return (rng or random).uniform(cap / 2, cap)


def retryable(status: int) -> bool:
    return status in (408, 429) or (status >= 500 and status not in NOT_RETRIED_5XX)


def retry_after(value: bytes | str | None, now: float | None = None) -> float | None:
    """Seconds to wait that a ``Retry-After`` value asks for (a number of seconds or an HTTP date);
    None when absent or unreadable."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        return max(0.0, when.timestamp() - (time.time() if now is None else now))
    return max(0.0, seconds) if math.isfinite(seconds) else None


@dataclass
class Reply:
    """One attempt's answer: its status, and whatever the caller needs to use it."""

    status: int
    retry_after: float | None = None
    value: Any = None


R = TypeVar("R", bound=Reply)


async def with_retries(
    attempt: Callable[[float], Awaitable[R]], policy: UpstreamPolicy, *,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    on_retry: Callable[[R | None, float], None] | None = None, deadlines: Deadlines | None = None,
) -> R:
    """Call ``attempt(deadline)`` until it answers a status not to retry, the attempts run out or the
    budget would be exceeded; its last answer. ``deadline`` (a ``clock`` time) bounds what the
    attempt may wait for itself (a rate limit). A last attempt that timed out is a 504. ``deadlines``
    times the attempts out (pass one per process: its calls then share one timer)."""
    deadline = clock() + policy.budget_s
    if deadlines is None:
        deadlines = Deadlines()
    for number in range(1, policy.max_attempts + 1):
        remaining = deadline - clock()
        reply: R | None = None
        # not wait_for (a task per attempt) nor asyncio.timeout (a timer per attempt): `Deadlines`
        task = deadlines.start(max(0.0, min(policy.timeout_s, remaining)))
        try:
            reply = await attempt(deadline)
        except asyncio.CancelledError:
            if not deadlines.expired(task):
                raise
            reply = None
        finally:
            deadlines.stop(task)
        if reply is not None and not retryable(reply.status):
            return reply
        if number == policy.max_attempts:
            break
        wait = reply.retry_after if reply is not None and reply.retry_after is not None else policy.backoff(number)
        if clock() + wait >= deadline:
            break  # the answer would come after the budget: give the one we have now
        if on_retry is not None:
            on_retry(reply, wait)
        await sleep(wait)
    if reply is None:
        raise ProxyError(504, f"the upstream did not answer in time ({number} attempts)", code="upstream_timeout")
    return reply
