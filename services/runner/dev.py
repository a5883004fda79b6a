"""The runner as a task of `fulmen dev` (see `fulmen.cli.dev`): the same runner, in the shared loop."""

from __future__ import annotations

import asyncio

from fulmen import keys as k
from fulmen.cli.dev import open_store, when_stopped
from fulmen.sdk.agent import load_agent
from fulmen.sdk.resources import close_async_pool
from fulmen.settings import RunnerSettings, load_settings
from fulmen.telemetry.http import start_ops
from fulmen.telemetry.tracing import setup_tracing
from fulmen_runner.runner import Runner


async def main(stop: asyncio.Event) -> None:
    settings = load_settings(RunnerSettings)
    if not settings.agent:
        raise ValueError("no agent: pass --agent module:function")
    agent = load_agent(settings.agent)
    provider, buffer = setup_tracing("fulmen-runner")
    store = await open_store(settings)
    runner = Runner(store, agent, buffer, concurrency=settings.concurrency, grace_s=settings.grace_s,
                    llm_base_url=settings.llm_base_url, proxy_api_key=settings.proxy_key())
    stopping = when_stopped(stop, runner.stop)
    try:
        with start_ops(settings, "runner", groups=[("queue", k.RUNNERS_GROUP)]):
            await runner.run()
        await close_async_pool()
    finally:
        stopping.cancel()
        provider.shutdown()
        await store.redis.aclose()
