"""`fulmen vllm-sync`. Kept light at import: `fulmen --help` loads this module."""

from __future__ import annotations

import asyncio
import logging
import signal

import typer

from fulmen.cli.service import run_on_store, settings_command
from fulmen.settings import VllmSyncSettings
from fulmen.store import RedisStore

log = logging.getLogger("fulmen.vllm_sync")


@settings_command(VllmSyncSettings)
def command(settings: VllmSyncSettings) -> None:
    """Keep one vLLM server serving the trainer's newest model version (run one beside each server).

    For each new version: write it where the server can read it, pause the server, reload the
    weights, set and check the served version, compare a canary completion before and after, reset
    the prefix cache, resume. Only then is the replica marked ready with that version in the store,
    and proxies route to it; a failed or hung load leaves it out of routing, logs what to do, and is
    tried again. The server must run in dev mode: VLLM_SERVER_DEV_MODE=1. LoRA versions load as
    adapters at run time, without a pause, when the server runs with --enable-lora and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (--lora-loading)."""
    if not settings.vllm_url:
        typer.echo("error: vllm-sync needs --vllm-url (FULMEN_VLLM_URL): the server it keeps in step", err=True)
        raise typer.Exit(2)
    if settings.model_dir is None:
        typer.echo("error: vllm-sync needs --model-dir: the base model the server started from", err=True)
        raise typer.Exit(2)

    async def work(store: RedisStore) -> None:
        from fulmen.telemetry.http import start_ops
        from fulmen_vllm_sync.admin import VllmAdmin
        from fulmen_vllm_sync.sync import VllmSync

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        key = settings.vllm_api_key.get_secret_value() if settings.vllm_api_key else None
        admin = VllmAdmin(settings.vllm_url or "", settings.sync_timeout_s, key)
        assert settings.model_dir is not None
        sync = VllmSync(store, admin, url=settings.replica_url or settings.vllm_url or "", model=settings.model_name,
                        model_dir=settings.model_dir, sync_dir=settings.sync_dir, pause_mode=settings.pause_mode,
                        retry_s=settings.sync_retry_s, lora_loading=settings.lora_loading)
        try:
            with start_ops(settings, "vllm-sync"):
                await sync.run(stop)
        finally:
            await admin.close()
        log.info("vllm-sync stopped: %d syncs, %d failed; %s serves %s", sync.syncs["ok"], sync.syncs["failed"],
                 settings.vllm_url, sync.state.model_version)

    run_on_store(settings, work)
