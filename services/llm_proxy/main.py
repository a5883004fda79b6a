"""The LLM proxy as a `Service`: `run(settings, stop)`, which `fulmen llm-proxy` and `fulmen dev` both
call. Kept light at import (`fulmen --help` loads it); the server: `fulmen_llm_proxy.server`, what one
proxy owns: `fulmen_llm_proxy.service`."""

from __future__ import annotations

import asyncio
import logging

from fulmen.cli.service import Service, before_stop, wait_for_model
from fulmen.errors import FulmenError
from fulmen.settings import ProxySettings

log = logging.getLogger("fulmen.llm_proxy")


async def run(settings: ProxySettings, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set. The torch backend serves --model-dir once it exists (the demo writes
    it after its warm start), the tiny model without one; a port or a backend setting that cannot
    serve raises FulmenError."""
    from fulmen_llm_proxy.server import serve

    if settings.proxy_backend == "torch" and settings.model_dir is None:
        from fulmen.cli.standalone import tiny_model_dir

        folder = await before_stop(asyncio.to_thread(tiny_model_dir, settings), stop, "building the tiny model")
        settings = settings.model_copy(update={"model_dir": folder})
        log.warning("no --model-dir: serving the tiny model in %s (random weights: a pipeline check)",
                    settings.model_dir)
    if settings.proxy_backend == "torch" and not await wait_for_model(settings.model_dir, stop):
        return
    try:
        await serve(settings, stop)
    except (OSError, ValueError) as e:
        raise FulmenError(str(e)) from None


SERVICE = Service("llm-proxy", ProxySettings, run)
