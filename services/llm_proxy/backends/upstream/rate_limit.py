"""A per-upstream rate limit: requests and tokens per minute, each a token bucket.

Calls are served in the order they asked; `RateLimiter.settle` corrects by the reported usage. The
bucket's rules: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fulmen_llm_proxy.errors import ProxyError

BURST_FRACTION = 0.1  # of the per-minute allowance
BYTES_PER_TOKEN = 4  # a usual estimate for English text and JSON
DEFAULT_COMPLETION_TOKENS = 256  # what a call without max_tokens is assumed to generate


class TokenBucket:
    def __init__(self, per_minute: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = max(1.0, per_minute * BURST_FRACTION)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.clock = clock
        self.updated = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def reserve(self, amount: float) -> float:
        """Take ``amount``; the seconds to wait until it is covered."""
        self._refill()
        self.level -= amount
        return 0.0 if self.level >= 0 else -self.level / self.rate

    def give_back(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)


class RateLimiter:
    """Requests and tokens per minute to one upstream (either may be None: not limited)."""

    def __init__(
        self, requests_per_minute: int | None, tokens_per_minute: int | None, *,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:  # fmt: skip
        self.requests = TokenBucket(requests_per_minute, clock) if requests_per_minute else None
        self.tokens = TokenBucket(tokens_per_minute, clock) if tokens_per_minute else None
        self.clock = clock
        self.sleep = sleep

    async def acquire(self, tokens: int, deadline: float) -> None:
        """Wait until one more request of about ``tokens`` tokens may go; 429 when that would pass
        ``deadline`` (a ``clock`` time)."""
        wait = self.requests.reserve(1) if self.requests else 0.0
        if self.tokens:
            wait = max(wait, self.tokens.reserve(tokens))
        if wait <= 0:
            return
        if self.clock() + wait > deadline:
            if self.requests:
                self.requests.give_back(1)
            if self.tokens:
                self.tokens.give_back(tokens)
            raise ProxyError(
                429, f"upstream rate limit (FULMEN_UPSTREAM_RPM / FULMEN_UPSTREAM_TPM): retry in {wait:.1f} s",
                code="rate_limit_exceeded",
            )  # fmt: skip
        await self.sleep(wait)

    def settle(self, estimated: int, used: int | None) -> None:
        """Correct the token bucket once the upstream said how many tokens the call used."""
        if self.tokens is not None and used is not None:
            self.tokens.give_back(estimated - used)


def estimate_tokens(payload: bytes, max_tokens: int | None, n: int = 1) -> int:
    """What a call will cost before it is sent: its body's bytes / 4 for the prompt, plus what it may
    generate."""
    return len(payload) // BYTES_PER_TOKEN + (max_tokens or DEFAULT_COMPLETION_TOKENS) * max(1, n)


def used_tokens(body: Any) -> int | None:
    """Tokens an answer reports (OpenAI ``usage.total_tokens``, or Anthropic's input plus output)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    parts = [usage.get(k) for k in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")]
    numbers = [p for p in parts if isinstance(p, int)]
    return sum(numbers) if numbers else None
