"""vllm-sync as a `Service`: `run(settings, stop)`, which `fulmen vllm-sync` calls (`fulmen dev` runs no
vLLM server, so no vllm-sync). Kept light at import (`fulmen --help` loads it); the sync itself:
`fulmen_vllm_sync.sync`."""

from __future__ import annotations

import asyncio
import logging

from fulmen.cli.service import Service, opened_store
from fulmen.errors import InvalidInput
from fulmen.settings import VllmSyncSettings

log = logging.getLogger("fulmen.vllm_sync")


async def run(settings: VllmSyncSettings, stop: asyncio.Event) -> None:
    """Keep the vLLM server at --vllm-url on the newest model version until ``stop`` is set (without
    --vllm-url or --model-dir, InvalidInput before anything connects)."""
    from fulmen.telemetry.http import start_ops
    from fulmen_vllm_sync.admin import VllmAdmin
    from fulmen_vllm_sync.sync import VllmSync

    if not settings.vllm_url:
        raise InvalidInput("vllm-sync needs --vllm-url (FULMEN_VLLM_URL): the server it keeps in step")
    if settings.model_dir is None:
        raise InvalidInput("vllm-sync needs --model-dir: the base model the server started from")
    async with opened_store(settings, stop) as store:
        key = settings.vllm_api_key.get_secret_value() if settings.vllm_api_key else None
        admin = VllmAdmin(settings.vllm_url, settings.sync_timeout_s, key)
        sync = VllmSync(store, admin, settings)
        try:
            with start_ops(settings, "vllm-sync"):
                await sync.run(stop)
        finally:
            await admin.close()
    log.info("vllm-sync stopped: %d syncs, %d failed; %s serves %s", sync.syncs["ok"], sync.syncs["failed"],
             settings.vllm_url, sync.state.model_version)


SERVICE = Service("vllm-sync", VllmSyncSettings, run)
