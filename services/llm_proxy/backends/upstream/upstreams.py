"""HTTP to upstream OpenAI-compatible servers: pooled keep-alive connections, sticky replicas.

Every call goes through `fulmen_llm_proxy.backends.upstream.policy.UpstreamPolicy`. Replica choice and
failover: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fulmen_llm_proxy.api import json_body
from fulmen_llm_proxy.backends.upstream.cache import ResponseCache
from fulmen_llm_proxy.backends.upstream.deadlines import Deadlines
from fulmen_llm_proxy.backends.upstream.http_client import HttpPool
from fulmen_llm_proxy.backends.upstream.policy import (
    Reply,
    UpstreamPolicy,
    retry_after,
    retryable,
    with_retries,
)
from fulmen_llm_proxy.backends.upstream.rate_limit import RateLimiter, estimate_tokens, used_tokens
from fulmen_llm_proxy.errors import ProxyError

log = logging.getLogger(__name__)

T = TypeVar("T")
LOAD_POLL_S = 0.05  # how often a waiting call looks again (the replica view is read every 0.5 s)


def normalize(url: str) -> str:
    """Base URL without a trailing ``/v1`` or slash: paths are appended as ``/v1/...``."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


Payload = bytes | Callable[[str], bytes]  # a body, or the body for a replica's base URL


@dataclass
class Sent(Reply):
    """An attempt's answer: the replica that took it and what it sent back (a body, or for a stream
    the connection its body comes on)."""

    pool: HttpPool | None = None
    data: bytes = b""


class Upstreams:
    def __init__(
        self, urls: list[str], api_key: str | None = None, *, policy: UpstreamPolicy | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        if not urls:
            raise ValueError("no upstream URL")
        # ``headers`` (an API's own, e.g. Anthropic's x-api-key) replace the bearer key
        headers = headers if headers is not None else {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.pools = [HttpPool(normalize(u), headers) for u in urls]
        self.policy = policy or UpstreamPolicy()
        limited = self.policy.requests_per_minute or self.policy.tokens_per_minute
        self.limits = {
            p.base_url: RateLimiter(self.policy.requests_per_minute, self.policy.tokens_per_minute) for p in self.pools
        } if limited else {}  # fmt: skip
        self.cache = ResponseCache(self.policy.cache_entries) if self.policy.cache_entries else None
        self.deadlines = Deadlines()  # every call's attempt timeout, on one timer
        self.retries = 0  # sends after a call's first, for metrics and tests
        self.load_waits = 0  # polls of calls that waited for a replica to finish loading
        self._round_robin = itertools.cycle(range(len(self.pools)))
        # which replicas may take calls now (vllm: not while loading a version); None: all
        self.routable: Callable[[str], bool] | None = None

    async def start(self) -> None:
        pass  # connections open on first use

    async def close(self) -> None:
        for pool in self.pools:
            pool.close()

    def order(self, rollout_id: str) -> list[HttpPool]:
        """Replicas in the order a rollout tries them: its sticky one first; only the routable ones."""
        pools = self._order(rollout_id)
        if self.routable is None:
            return pools
        ready = [p for p in pools if self.routable(p.base_url)]
        if not ready:
            raise ProxyError(503, "no upstream replica is ready: a model version is loading; retry shortly",
                             code="upstream_loading")
        return ready

    async def ready_order(self, rollout_id: str) -> list[HttpPool]:
        """`order`, waiting up to the policy's ``load_wait_s`` while no replica is routable (each is
        loading a model version: with one replica, every reload), so the call is served by the new
        version rather than refused; a 503 only once the wait is spent."""
        deadline = time.monotonic() + self.policy.load_wait_s
        while True:
            try:
                return self.order(rollout_id)
            except ProxyError as e:
                if e.code != "upstream_loading" or time.monotonic() >= deadline:
                    raise
            self.load_waits += 1
            await asyncio.sleep(LOAD_POLL_S)

    def _order(self, rollout_id: str) -> list[HttpPool]:
        if len(self.pools) == 1:
            return self.pools
        if not rollout_id:
            first = next(self._round_robin)
            return self.pools[first:] + self.pools[:first]

        def score(pool: HttpPool) -> bytes:
            return hashlib.blake2b(f"{pool.base_url}|{rollout_id}".encode(), digest_size=8).digest()

        return sorted(self.pools, key=score, reverse=True)

    async def _first_reachable(
        self, rollout_id: str, send: Callable[[HttpPool], Awaitable[T]]
    ) -> tuple[HttpPool, T]:
        """``send`` to the rollout's replica, or the next one when it cannot be reached; the replica
        that took it and its reply."""
        last: Exception | None = None
        for pool in await self.ready_order(rollout_id):
            try:
                return pool, await send(pool)
            except (OSError, TimeoutError) as e:
                if not _unreachable(e):
                    raise ProxyError(
                        502, f"upstream {pool.base_url} failed: {e}", code="upstream_error"
                    ) from None
                last = e  # refused or unreachable: nothing was sent, the next replica may serve it
        raise _no_upstream(last)

    async def _limit(self, pool: HttpPool, cost: int, deadline: float) -> None:
        limiter = self.limits.get(pool.base_url)
        if limiter is not None:
            await limiter.acquire(cost, deadline)

    def _retrying(self, reply: Sent | None, wait: float) -> None:
        self.retries += 1
        what = f"answered {reply.status}" if reply is not None else "timed out"
        log.info("upstream %s; retrying in %.2f s", what, wait)

    async def post_json(
        self, path: str, payload: Payload, rollout_id: str, on_send: Callable[[str], None] | None = None, *,
        cost: int | None = None, cache_key: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """POST and return the JSON reply; upstream errors become ProxyErrors (4xx kept, 5xx -> 502).
        ``on_send`` is told the base URL of the replica the call goes to, just before it goes;
        ``payload`` may depend on that replica (a function of its base URL). ``cost``: the call's estimated tokens for the rate limit; ``cache_key``: answer from (and
        store in) the response cache under this key (`response_cache.request_key`)."""
        if cache_key is not None and self.cache is not None:
            cached = self.cache.get(cache_key)
            if cached is not None:
                return cached
        tokens = cost if cost is not None else estimate_tokens(_body(payload, None), None)

        async def attempt(deadline: float) -> Sent:
            async def send(pool: HttpPool) -> tuple[int, bytes, bytes | None]:
                await self._limit(pool, tokens, deadline)
                return await _sent(pool, on_send).post_reply(path, _body(payload, pool))

            try:
                pool, (status, data, after) = await self._first_reachable(rollout_id, send)
            except ProxyError as e:
                if e.code != "upstream_error":
                    raise
                # the connection broke after the request went (the upstream crashed or restarted):
                # as a 502 from it, retried
                return Sent(502, data=e.body())
            return Sent(status, retry_after(after), pool=pool, data=data)

        reply = await with_retries(attempt, self.policy, on_retry=self._retrying, deadlines=self.deadlines)
        if reply.status != 200:
            raise upstream_error(reply.status, reply.data)
        try:
            body: dict[str, Any] = json_body.loads(reply.data)
        except ValueError:
            raise ProxyError(502, "upstream sent a body that is not JSON", code="upstream_error") from None
        limiter = self.limits.get(reply.pool.base_url) if reply.pool is not None else None
        if limiter is not None:
            limiter.settle(tokens, used_tokens(body))
        if cache_key is not None and self.cache is not None:
            self.cache.put(cache_key, reply.data)
        return body

    async def _open_stream(
        self, path: str, payload: Payload, rollout_id: str, on_send: Callable[[str], None] | None,
        cost: int | None,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """POST a streaming request (retried as the policy says) and return the body of its 200 answer;
        any other answer is a ProxyError."""
        tokens = cost if cost is not None else estimate_tokens(_body(payload, None), None)

        async def attempt(deadline: float) -> Sent:
            async def send(pool: HttpPool) -> tuple[int, Any]:
                await self._limit(pool, tokens, deadline)
                return await _sent(pool, on_send).post_stream(path, _body(payload, pool))

            pool, (status, conn) = await self._first_reachable(rollout_id, send)
            if retryable(status):
                after = retry_after(conn.retry_after)
                conn.abort()  # its body is not wanted: another attempt follows, or the error below
                return Sent(status, after, pool=pool)
            return Sent(status, pool=pool, value=conn)

        reply = await with_retries(attempt, self.policy, on_retry=self._retrying, deadlines=self.deadlines)
        if reply.value is None:
            raise upstream_error(reply.status, b"")
        assert reply.pool is not None
        body = reply.pool.stream_body(reply.value)
        if reply.status != 200:
            raise upstream_error(reply.status, b"".join([piece async for piece in body]))
        return body

    async def post_sse(
        self, path: str, payload: Payload, rollout_id: str, on_send: Callable[[str], None] | None = None, *,
        cost: int | None = None,
    ) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        """POST a streaming request and yield each ``data:`` event as JSON until ``[DONE]``."""
        body = await self._open_stream(path, payload, rollout_id, on_send, cost)
        buffer = b""
        try:
            async for piece in body:
                buffer += piece
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event: lines
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    try:
                        event = json_body.loads(data)
                    except ValueError:
                        raise ProxyError(
                            502, "upstream sent an event that is not JSON", code="upstream_error"
                        ) from None
                    if "error" in event and "choices" not in event:
                        raise upstream_error(502, data)
                    yield event
        except OSError as e:
            raise ProxyError(502, f"upstream failed mid-stream: {e}", code="upstream_error") from None
        finally:
            await body.aclose()


def _body(payload: Payload, pool: HttpPool | None) -> bytes:
    """The body for ``pool``'s replica (any replica's when None: for sizing)."""
    return payload if isinstance(payload, bytes) else payload(pool.base_url if pool is not None else "")


def _sent(pool: HttpPool, on_send: Callable[[str], None] | None) -> HttpPool:
    if on_send is not None:
        on_send(pool.base_url)
    return pool


def _unreachable(error: BaseException) -> bool:
    """Nothing was sent: the connection could not be made."""
    return isinstance(error, ConnectionRefusedError | TimeoutError) or (
        isinstance(error, OSError) and not isinstance(error, ConnectionError)
    )


def _no_upstream(last: Exception | None) -> ProxyError:
    return ProxyError(
        502, f"no upstream reachable ({type(last).__name__}: {last})", code="upstream_unreachable"
    )


def upstream_error(status: int, data: bytes) -> ProxyError:
    """The upstream's error as ours: its message kept; 4xx status kept (the request was wrong), else 502."""
    message, param, code = f"upstream answered {status}", None, None
    try:
        error = json.loads(data).get("error")
        if isinstance(error, dict):
            message = str(error.get("message") or message)
            param, code = error.get("param"), error.get("code")
        elif isinstance(error, str):
            message = error
    except (ValueError, AttributeError):
        pass
    if 400 <= status < 500:
        return ProxyError(status, message, param=param, code=code)
    return ProxyError(502, f"upstream error: {message}", param=param, code=code or "upstream_error")
