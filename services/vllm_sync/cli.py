"""`fulmen vllm-sync`. Kept light at import: `fulmen --help` loads this module."""

from __future__ import annotations

from fulmen.cli.service import run_service, service_command
from fulmen.settings import VllmSyncSettings
from fulmen_vllm_sync.main import SERVICE


@service_command(SERVICE)
def command(settings: VllmSyncSettings) -> None:
    """Keep one vLLM server serving the trainer's newest model version (run one beside each server).

    For each new version: write it where the server can read it, pause the server, reload the
    weights, set and check the served version, compare a canary completion before and after, reset
    the prefix cache, resume. Only then is the replica marked ready with that version in the store,
    and proxies route to it; a failed or hung load leaves it out of routing, logs what to do, and is
    tried again. The server must run in dev mode: VLLM_SERVER_DEV_MODE=1. LoRA versions load as
    adapters at run time, without a pause, when the server runs with --enable-lora and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (--lora-loading)."""
    run_service(SERVICE, settings)
