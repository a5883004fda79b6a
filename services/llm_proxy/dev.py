"""The LLM proxy as a task of `fulmen dev` (see `fulmen.cli.dev`): its uvicorn server in the shared loop."""

from __future__ import annotations

import asyncio
import os

from fulmen.cli.dev import serve_http, wait_for_model
from fulmen.settings import ProxySettings, load_settings
from fulmen_llm_proxy.server import DEFAULT_PORT, bind, build


async def main(stop: asyncio.Event) -> None:
    settings = load_settings(ProxySettings)
    if settings.proxy_backend == "torch" and not await wait_for_model(settings.model_dir, stop):
        return
    port = settings.proxy_port if settings.proxy_port is not None else int(os.environ.get("PORT", DEFAULT_PORT))
    sock = bind(settings.proxy_host, port)
    import uvicorn

    _, config = build(settings, sock)
    await serve_http(uvicorn.Server(config), sock, stop)
