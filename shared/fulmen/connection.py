"""Connecting to Redis: wait with backoff and a clear log line, never print a password."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time

import redis.asyncio as aioredis
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

from fulmen.errors import RedisUnavailable
from fulmen.settings import CommonSettings

log = logging.getLogger(__name__)

# Seconds between PINGs on an idle connection: how soon a dead connection is noticed.
HEALTH_CHECK_S = 30
CONNECT_TIMEOUT_S = 5
# Jittered exponential backoff while Redis comes up, and a log line every LOG_EVERY attempts.
FIRST_DELAY_S = 0.1
MAX_DELAY_S = 2.0
LOG_EVERY = 10


# A secret in a URL's query (redis-py reads ?password=): its value runs to the next "&" or the end.
_QUERY_SECRET = re.compile(r"[?&][^=&?]*(?:password|passwd|pwd|secret|token)[^=&]*=([^&]*)", re.IGNORECASE)
REDACTED = "***"


def redact(url: str) -> str:
    """The URL with every password replaced, fit for a log line.

    Not parsed as a URL: a password written unencoded may hold "/", "#", "?" or "@", which a parser
    takes for the end of the authority (then the rest of the password would be printed). So the
    userinfo's password is everything from the first ":" after "scheme://" to the last "@", and a
    query secret (``?password=``) everything to the next "&". Where the two overlap (an "@" inside a
    query password) more than the secret is hidden, never less."""
    hidden: list[tuple[int, int]] = []
    scheme = url.find("://")
    at = url.rfind("@")
    if scheme >= 0 and at > scheme:
        colon = url.find(":", scheme + 3, at)
        if colon >= 0:  # user:password@ (a lone name before "@" is the ACL user, not a secret)
            hidden.append((colon + 1, at))
    hidden += [m.span(1) for m in _QUERY_SECRET.finditer(url) if m.end(1) > m.start(1)]
    if not hidden:
        return url
    out, pos = [], 0
    for start, end in sorted(hidden):
        if end <= pos:
            continue
        out += [url[pos:max(start, pos)], REDACTED if start >= pos else ""]
        pos = end
    return "".join(out) + url[pos:]


async def connect(settings: CommonSettings, *, wait_s: float | None = None) -> aioredis.Redis:
    """A client for the configured Redis, once it answers PING. Waits with jittered exponential
    backoff (services start in any order), up to ``wait_s`` (default: settings.redis_wait_s)."""
    url = settings.redis_url_value()
    # No socket timeout: blocking reads (claim, wait_for_rollouts, subscriptions) may wait longer
    # than any fixed value; a dead connection is caught by the health check instead.
    client = aioredis.from_url(url, health_check_interval=HEALTH_CHECK_S, socket_timeout=None,
                              socket_connect_timeout=CONNECT_TIMEOUT_S)
    wait_s = settings.redis_wait_s if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    delay = FIRST_DELAY_S
    attempt = 0
    while True:
        attempt += 1
        try:
            await client.ping()
            if attempt > 1:
                log.info("Redis at %s is up after %d attempts", redact(url), attempt)
            return client
        except (ConnectionError, TimeoutError, BusyLoadingError, OSError) as e:
            if time.monotonic() + delay > deadline:
                await client.aclose()
                hint = "start it with `fulmen redis`" if settings.embedded else "check REDIS_URL"
                raise RedisUnavailable(
                    f"Redis at {redact(url)} did not answer within {wait_s:.0f}s ({e}); {hint}"
                ) from None
            if attempt == 1 or attempt % LOG_EVERY == 0:
                log.info("waiting for Redis at %s (%s)", redact(url), type(e).__name__)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, MAX_DELAY_S)
