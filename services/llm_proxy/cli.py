"""`fulmen llm-proxy`: the command; every option is also a FULMEN_<NAME> environment variable."""

from __future__ import annotations

import typer

from fulmen.cli.service import settings_command
from fulmen.settings import ProxySettings

# The proxy's flags keep their short historical names next to the settings' names.
NAMES = {
    "proxy_host": ("--host", "--proxy-host"),
    "proxy_port": ("--port", "--proxy-port"),
    "proxy_backend": ("--backend", "--proxy-backend"),
}


@settings_command(ProxySettings, also=("log_level",), names=NAMES)
def command(settings: ProxySettings) -> None:
    """Serve an OpenAI-compatible API that records every LLM call as a span of its rollout attempt.

    Agents use http://<host>:<port>/rollout/<rollout id>/attempt/<attempt id>/v1 as their base URL
    (runners hand it out). API keys come only from the environment (FULMEN_PROXY_API_KEYS,
    FULMEN_UPSTREAM_API_KEY), never from a flag that `ps` would show."""
    from fulmen_llm_proxy.server import serve

    if settings.proxy_backend == "torch" and settings.model_dir is None:
        from fulmen.cli.standalone import tiny_model_dir

        settings = settings.model_copy(update={"model_dir": tiny_model_dir(settings)})
        typer.echo(f"no --model-dir: serving the tiny model in {settings.model_dir} (random weights: a "
                   "pipeline check)", err=True)
    if settings.proxy_backend == "torch" and settings.model_dir is not None:
        from fulmen.versions.model_version import wait_for_model_dir

        wait_for_model_dir(settings.model_dir)  # the demo writes its model after the warm start
    try:
        serve(settings)
    except (OSError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
