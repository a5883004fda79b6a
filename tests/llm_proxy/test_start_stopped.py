"""A proxy told to stop while it starts (its model loading) registers nothing and announces nothing."""

from __future__ import annotations

import asyncio

from fulmen.settings import ProxySettings
from fulmen.store import RedisStore
from fulmen_llm_proxy.backends.registry import make_backend
from fulmen_llm_proxy.service import ProxyService


def _service(redis_url: str, experiment: str, stopping: asyncio.Event, stop_while_loading: bool) -> ProxyService:
    """A proxy on an upstream backend whose start (the load) sets ``stopping`` when asked, as SIGTERM would."""
    settings = ProxySettings(redis_url=redis_url, experiment=experiment, proxy_backend="openai",
                             upstream_urls="http://127.0.0.1:9/v1")
    backend = make_backend(settings)
    load = backend.start

    async def load_then_sigterm() -> None:
        await load()
        if stop_while_loading:
            stopping.set()

    backend.start = load_then_sigterm  # type: ignore[method-assign]
    return ProxyService(settings, "http://127.0.0.1:9", backend, stopping=stopping)


async def test_a_proxy_stopped_while_loading_does_not_register(real_store: RedisStore, redis_url: str) -> None:
    """SIGTERM during the load: start returns without registering; the same proxy unstopped registers."""
    stopping = asyncio.Event()
    stopped = _service(redis_url, real_store.experiment, stopping, stop_while_loading=True)
    await stopped.start()
    assert await real_store.registry.query_proxies(max_age_s=None) == []
    running = _service(redis_url, real_store.experiment, asyncio.Event(), stop_while_loading=False)
    await running.start()
    try:
        assert [p.base_url for p in await real_store.registry.query_proxies()] == ["http://127.0.0.1:9"]
    finally:
        await running.close()
