"""The adapter as a task of `fulmen dev` (see `fulmen.cli.dev`)."""

from __future__ import annotations

import asyncio

from fulmen import keys as k
from fulmen.cli.dev import open_store
from fulmen.settings import AdapterSettings, load_settings
from fulmen.telemetry.http import start_ops
from fulmen_adapter.adapter import Adapter
from fulmen_adapter.config import adapter_config


async def main(stop: asyncio.Event) -> None:
    settings = load_settings(AdapterSettings)
    config = adapter_config(settings)
    store = await open_store(settings)
    try:
        with start_ops(settings, "adapter", groups=[("finished", k.ADAPTER_GROUP)]):
            await Adapter(store, config).run(stop)
    finally:
        await store.redis.aclose()
