"""What an agent receives besides its task: the LLM to call and prompt templates (Agent Lightning's
``LLM`` and ``PromptTemplate``), built by the runner from a resources snapshot in the store."""

from __future__ import annotations

import contextlib
import string
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fulmen.telemetry import semconv

# What the OpenAI client sends when the runner has no key (it refuses an empty one); a proxy without
# FULMEN_PROXY_API_KEYS accepts any.
NO_API_KEY = "fulmen"


@dataclass
class LLM:
    """An OpenAI-compatible endpoint for one attempt.

    ``base_url`` already points at a proxy with this attempt's path prefix, so every call the agent
    makes is recorded against its rollout. ``client`` / ``async_client`` are ready OpenAI clients that
    also carry the trace context, so the proxy's span joins the agent's trace."""

    base_url: str
    model: str
    sampling_parameters: dict[str, Any] = field(default_factory=dict)
    # The runner's key for the proxy (FULMEN_PROXY_API_KEY, else the first of FULMEN_PROXY_API_KEYS);
    # upstream keys never reach here. Out of the repr: an agent may print its LLM.
    api_key: str = field(default=NO_API_KEY, repr=False)
    headers: dict[str, str] = field(default_factory=dict)
    model_version: str | None = None
    _client: Any = field(default=None, init=False, repr=False, compare=False)
    _async_client: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def endpoint(self) -> str:  # Agent Lightning's name for it
        return self.base_url

    @property
    def client(self) -> Any:
        """A synchronous ``openai.OpenAI`` client for this attempt (its HTTP pool is the process's)."""
        if self._client is None:
            import openai

            self._client = openai.OpenAI(
                base_url=self.base_url, api_key=self.api_key, default_headers=self.headers, http_client=_sync_http()
            )
        return _idempotent(self._client)

    @property
    def async_client(self) -> Any:
        """An ``openai.AsyncOpenAI`` client for this attempt (its HTTP pool is the event loop's)."""
        if self._async_client is None:
            import openai

            self._async_client = openai.AsyncOpenAI(
                base_url=self.base_url, api_key=self.api_key, default_headers=self.headers, http_client=_async_http()
            )
        return _idempotent(self._async_client)

    def close(self) -> None:
        """Nothing to release: the HTTP pools are shared by every attempt of the process."""

    async def aclose(self) -> None:
        self.close()


def _idempotent(client: Any) -> Any:
    """Have the openai client send its per-call idempotency key (generated once per call, the same on
    each of its retries) so the proxy stores a retried call once and answers it from the store.
    The openai client keeps the header name in ``_idempotency_header`` (None by default)."""
    client._idempotency_header = semconv.HEADER_IDEMPOTENCY_KEY
    return client


# One HTTP pool per process (sync) and per event loop (async), shared by every attempt: building an
# httpx client costs milliseconds (an SSL context), a thousand times what a call to a local proxy does.
_sync_pool: Any = None
# keyed by the loop itself, weakly: an id() could be reused by a later loop, which would then get a
# pool bound to a closed one
_async_pools: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_POOL_LIMITS = {"max_connections": 1024, "max_keepalive_connections": 256}


def _sync_http() -> Any:
    global _sync_pool
    if _sync_pool is None:
        import httpx

        _sync_pool = httpx.Client(event_hooks={"request": [_inject_trace_context]}, timeout=600.0,
                                  limits=httpx.Limits(**_POOL_LIMITS))
    return _sync_pool


def _async_http() -> Any:
    import asyncio

    loop = asyncio.get_running_loop()
    pool = _async_pools.get(loop)
    if pool is None:
        pool = _async_pools[loop] = _new_async_pool()
        # Closed when the loop shuts down (`asyncio.run` closes every async generator still open
        # before it closes the loop), so a user's script that never calls `close_async_pool` does not
        # end with aiohttp's "Unclosed client session" warnings. The generator is held by the loop
        # itself: a dict keyed weakly by the loop would keep it alive (the generator refers to it).
        closer = _close_at_shutdown(loop, pool)
        with contextlib.suppress(StopIteration):
            closer.asend(None).send(None)  # to its yield, now: registered with this loop
        setattr(loop, _CLOSER_ATTRIBUTE, closer)
    return pool


_CLOSER_ATTRIBUTE = "_fulmen_http_pool_closer"


async def _close_at_shutdown(loop: Any, pool: Any) -> AsyncIterator[None]:
    try:
        yield
    finally:
        if _async_pools.get(loop) is pool:  # a loop used again after its shutdown gets a new pool
            del _async_pools[loop]
        await pool.aclose()


async def close_async_pool() -> None:
    """Close this event loop's HTTP pool (before the loop ends: aiohttp warns about an unclosed
    session and connector otherwise). The next attempt on this loop opens a new one."""
    import asyncio

    loop = asyncio.get_running_loop()
    _async_pools.pop(loop, None)
    closer = getattr(loop, _CLOSER_ATTRIBUTE, None)
    if closer is not None:
        delattr(loop, _CLOSER_ATTRIBUTE)
        await closer.aclose()  # closes the pool


def _new_async_pool() -> Any:
    """aiohttp under the OpenAI client when it is installed: httpx's pool rescans every connection on
    each request, which at 64 concurrent calls made it half the runner's CPU (bench/RESULTS.md)."""
    hooks = {"request": [_inject_trace_context_async]}
    try:
        import openai

        return openai.DefaultAioHttpClient(event_hooks=hooks, timeout=600.0)
    except (ImportError, RuntimeError):  # openai without its aiohttp extra
        import httpx

        return httpx.AsyncClient(event_hooks=hooks, timeout=600.0, limits=httpx.Limits(**_POOL_LIMITS))


def _inject_trace_context(request: Any) -> None:
    from opentelemetry import propagate

    propagate.inject(request.headers)


async def _inject_trace_context_async(request: Any) -> None:
    _inject_trace_context(request)


@dataclass(frozen=True)
class PromptTemplate:
    """A prompt template resource; ``engine`` is "f-string" (``{name}``) or "string.Template" (``$name``)."""

    template: str
    engine: str = "f-string"

    def format(self, **values: Any) -> str:
        if self.engine == "f-string":
            return self.template.format(**values)
        if self.engine == "string.Template":
            return string.Template(self.template).substitute(**values)
        raise ValueError(f"prompt template engine {self.engine!r} unknown; use f-string or string.Template")


def llm_for_attempt(
    spec: dict[str, Any],
    proxy_base_url: str,
    rollout_id: str,
    attempt_id: str,
    *,
    model: str = "",
    api_key: str | None = None,
) -> LLM:
    """The agent's `LLM` from the "llm" resource and the proxy that serves it: the proxy's base URL
    with this attempt's path prefix (so a framework's own client, which sends no Fulmen header, is
    still recorded against the rollout), the resource's model or else ``model`` (what the proxy
    serves), and the runner's bearer ``api_key`` for it (None: `NO_API_KEY`)."""
    root = proxy_base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    headers = {semconv.HEADER_ROLLOUT_ID: rollout_id, semconv.HEADER_ATTEMPT_ID: attempt_id}
    return LLM(
        base_url=f"{root}{semconv.attempt_path(rollout_id, attempt_id)}/v1",
        model=str(spec.get("model") or model),
        sampling_parameters=dict(spec.get("sampling_parameters") or {}),
        api_key=api_key or NO_API_KEY,
        headers=headers,
        model_version=spec.get("model_version"),
    )


class MissingLLM:
    """What an agent gets as ``llm`` when there is no LLM to give it: any use says why, and what to do
    (instead of ``'NoneType' object has no attribute 'base_url'``)."""

    def __init__(self, reason: str) -> None:
        self._reason = reason

    def __getattr__(self, name: str) -> Any:
        from fulmen.errors import FulmenError

        raise FulmenError(f"no LLM for this attempt (llm.{name}): {self._reason}")

    def __bool__(self) -> bool:
        return False

    def close(self) -> None:
        """Nothing to release (the runner closes every attempt's LLM)."""

    async def aclose(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return f"MissingLLM({self._reason!r})"


def prompt_template_of(spec: Any) -> PromptTemplate:
    if isinstance(spec, str):
        return PromptTemplate(spec)
    if isinstance(spec, dict) and isinstance(spec.get("template"), str):
        return PromptTemplate(spec["template"], spec.get("engine", "f-string"))
    raise ValueError(f"prompt template resource must be a string or {{'template': ...}}, got {spec!r}")
