"""Connecting to Redis: wait with backoff and a clear log line, never print a password; then ride out
outages.

`OutageRetry` retries every command through an outage of up to ``redis_outage_s``; Redis Cluster URLs
are recognised here. Why retrying is safe: docs/design/store.md.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from typing import Any
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    ConnectionError,
    RedisError,
    SlotNotCoveredError,
    TimeoutError,
    TryAgainError,
)

from fulmen.errors import RedisUnavailable
from fulmen.settings import CommonSettings

log = logging.getLogger(__name__)

# Seconds between PINGs on an idle connection: how soon a dead connection is noticed.
HEALTH_CHECK_S = 30
CONNECT_TIMEOUT_S = 5
# Jittered exponential backoff while Redis comes up; after HINT_AFTER_S, and every HINT_EVERY_S after
# that, a warning says what is awaited and what to do.
FIRST_DELAY_S = 0.1
MAX_DELAY_S = 2.0
HINT_AFTER_S = 3.0
HINT_EVERY_S = 10.0
# Backoff between retries of a command during an outage (jittered; the cap keeps reconnects prompt).
OUTAGE_FIRST_DELAY_S = 0.05
OUTAGE_MAX_DELAY_S = 1.0


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


CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
# What makes a cluster command fail for a while: a node down (its slots uncovered), a failover.
CLUSTER_OUTAGE_ERRORS = (ConnectionError, TimeoutError, ClusterDownError, SlotNotCoveredError, TryAgainError)


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def cluster_options(url: str) -> dict[str, Any]:
    """redis-py `RedisCluster` arguments from a ``redis+cluster://[user:password@]h:p[,h:p]`` URL."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"{redact(url)} is no cluster URL: use redis+cluster://host:port[,host:port]")
    userinfo, at, hosts = rest.rpartition("@")
    hosts = hosts.split("/", 1)[0].split("?", 1)[0]  # a cluster has one database: no path, no query
    options: dict[str, Any] = {"ssl": CLUSTER_SCHEMES[scheme.lower()]}
    if at:
        user, colon, password = userinfo.partition(":")
        options["username"] = unquote(user) or None
        options["password"] = unquote(password) if colon else None
    nodes = []
    for node in filter(None, (h.strip() for h in hosts.split(","))):
        host, colon, port = node.rpartition(":")
        if not colon or not port.isdigit() or not host:
            raise ValueError(f"cluster node {node!r} in {redact(url)} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError(f"{redact(url)} names no cluster node")
    options["nodes"] = nodes
    return options


class OutageCluster(AsyncRedisCluster):
    """redis-py's async cluster client whose commands ride out an outage as `OutageRetry` does for a
    single node (the cluster's own retry is a count, a few tries in well under a second)."""

    outage: OutageRetry | None = None

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self.outage is None:
            return await super().execute_command(*args, **kwargs)
        return await self.outage.call_with_retry(
            lambda: super(OutageCluster, self).execute_command(*args, **kwargs), _nothing
        )


async def _nothing(error: BaseException) -> None:
    return None


def async_client(url: str, **kwargs: Any) -> aioredis.Redis:
    """An async client for ``url``: `OutageCluster` for a cluster URL, else a plain client.
    (Typed as the plain client: the cluster client has the same command methods.)"""
    if is_cluster_url(url):
        options = cluster_options(url)
        nodes = [ClusterNode(host, port) for host, port in options.pop("nodes")]
        return OutageCluster(startup_nodes=nodes, **options, **kwargs)  # type: ignore[return-value]
    return aioredis.from_url(url, **kwargs)


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """A sync client for ``url`` (the metrics thread, `fulmen top`): a cluster URL, or a plain URL of
    a node in cluster mode, gives redis-py's `RedisCluster`."""
    if is_cluster_url(url):
        options = cluster_options(url)
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in options.pop("nodes")]
        return redis.RedisCluster(startup_nodes=nodes, **options, **kwargs)  # type: ignore[return-value]
    client = redis.Redis.from_url(url, **kwargs)
    try:
        enabled = client.info("cluster").get("cluster_enabled") == 1
    except (RedisError, OSError):
        return client  # not reachable now: the caller's first command says so
    if not enabled:
        return client
    client.close()
    return redis.RedisCluster.from_url(url, **kwargs)  # type: ignore[return-value]


async def _cluster_mode(client: aioredis.Redis) -> bool:
    """Whether the node behind a plain URL runs in cluster mode (some managed Redis refuse INFO:
    then not)."""
    try:
        return (await client.info("cluster")).get("cluster_enabled") == 1
    except RedisError:
        return False


async def connect_weights(settings: CommonSettings, *, wait_s: float | None = None) -> aioredis.Redis | None:
    """A client for the weights-only Redis (``weights_redis_url``), or None when the weights live in
    the main Redis (the default)."""
    if settings.weights_redis_url is None:
        return None
    return await connect(settings.model_copy(update={"redis_url": settings.weights_redis_url}), wait_s=wait_s)


async def connect(settings: CommonSettings, *, wait_s: float | None = None) -> aioredis.Redis:
    """A client for the configured Redis, once it answers PING. Waits with jittered exponential
    backoff (services start in any order), up to ``wait_s`` (default: settings.redis_wait_s)."""
    url = settings.redis_url_value()
    # No socket timeout: blocking reads (claim, wait_for_rollouts, subscriptions) may wait longer
    # than any fixed value; a dead connection is caught by the health check instead.
    options: dict[str, Any] = {"health_check_interval": HEALTH_CHECK_S, "socket_timeout": None,
                               "socket_connect_timeout": CONNECT_TIMEOUT_S}
    client = async_client(url, **options)
    wait_s = settings.redis_wait_s if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    delay = FIRST_DELAY_S
    attempt = 0
    started = time.monotonic()
    next_hint = started + HINT_AFTER_S
    while True:
        attempt += 1
        try:
            await client.ping()
            if attempt > 1:
                log.info("Redis at %s is up after %d attempts", redact(url), attempt)
            if not isinstance(client, OutageCluster) and await _cluster_mode(client):
                await client.aclose()
                client = OutageCluster.from_url(url, **options)
                await client.ping()
            # From now on a lost connection is an outage to ride out, not the end of the process.
            if isinstance(client, OutageCluster):
                client.outage = OutageRetry(url, settings.redis_outage_s, CLUSTER_OUTAGE_ERRORS)
            else:
                client.set_retry(OutageRetry(url, settings.redis_outage_s))
            return client
        except (*CLUSTER_OUTAGE_ERRORS, BusyLoadingError, OSError) as e:
            if time.monotonic() + delay > deadline:
                await client.aclose()
                raise RedisUnavailable(
                    f"Redis at {redact(url)} did not answer within {wait_s:.0f}s ({e}); {_redis_hint(settings)}"
                ) from None
            if attempt == 1:
                log.info("waiting for Redis at %s (%s)", redact(url), type(e).__name__)
            elif time.monotonic() >= next_hint:
                next_hint = time.monotonic() + HINT_EVERY_S
                log.warning("still waiting for Redis at %s (%s) after %.0f s of %.0f: %s", redact(url),
                            type(e).__name__, time.monotonic() - started, wait_s, _redis_hint(settings))
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, MAX_DELAY_S)


def _redis_hint(settings: CommonSettings) -> str:
    """What to do when Redis does not answer, for the log line and the error."""
    if settings.embedded:
        return ("start the embedded one with `fulmen redis` in another terminal (or run everything with "
                "`honcho start`), or set REDIS_URL to a Redis of your own")
    return "check that REDIS_URL names a running server you can reach"


class OutageRetry(Retry):
    """redis-py's retry of a failed command, bounded by time rather than by count, that says once
    when Redis went away and once when it is back (with how long it was gone). One per client: its
    coroutines share the outage, so they share the log lines too."""

    def __init__(self, url: str, outage_s: float,
                 errors: tuple[type[Exception], ...] = (ConnectionError, TimeoutError)) -> None:
        # BusyLoadingError is a ConnectionError
        super().__init__(ExponentialWithJitterBackoff(OUTAGE_MAX_DELAY_S, OUTAGE_FIRST_DELAY_S), -1, errors)
        self.url, self.outage_s = url, outage_s
        self.down_since: float | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> OutageRetry:
        return self  # redis-py copies a connection's retry; one outage is one state for the client

    async def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                              with_failure_count: bool = False) -> Any:
        failures = 0
        while True:
            try:
                result = await do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                await (fail(error, failures) if with_failure_count else fail(error))
                now = time.monotonic()
                if self.down_since is None:
                    self.down_since = now
                    log.warning("Redis at %s unreachable (%s): reconnecting for up to %.0f s",
                                redact(self.url), type(error).__name__, self.outage_s)
                if now - self.down_since >= self.outage_s:
                    raise
                await asyncio.sleep(self._backoff.compute(failures))
                continue
            if self.down_since is not None:
                log.warning("Redis at %s is back after an outage of %.1f s",
                            redact(self.url), time.monotonic() - self.down_since)
                self.down_since = None
            return result
