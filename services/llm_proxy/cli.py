"""`fulmen llm-proxy`: the command; every option is also a FULMEN_<NAME> environment variable."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from fulmen.errors import FulmenError
from fulmen.settings import load_settings


def command(
    experiment: Annotated[
        str | None,
        typer.Option("--experiment", "-e", help="Experiment (env FULMEN_EXPERIMENT; default: default)."),
    ] = None,
    proxy_host: Annotated[
        str | None,
        typer.Option("--host", "--proxy-host", help="Listen address (env FULMEN_PROXY_HOST; 127.0.0.1)."),
    ] = None,
    proxy_port: Annotated[
        int | None,
        typer.Option("--port", "--proxy-port", help="Port (env FULMEN_PROXY_PORT, else $PORT, else 8000)."),
    ] = None,
    proxy_public_url: Annotated[
        str | None, typer.Option(help="Base URL registered for runners (env FULMEN_PROXY_PUBLIC_URL).")
    ] = None,
    proxy_backend: Annotated[
        str | None,
        typer.Option(
            "--backend", "--proxy-backend", help="torch, vllm or openai (env FULMEN_PROXY_BACKEND)."
        ),
    ] = None,
    model_dir: Annotated[
        Path | None, typer.Option(help="Hugging Face model folder (torch backend) (env FULMEN_MODEL_DIR).")
    ] = None,
    model_name: Annotated[
        str | None,
        typer.Option(help="Model name served (default: the folder's name) (env FULMEN_MODEL_NAME)."),
    ] = None,
    upstream_urls: Annotated[
        str | None,
        typer.Option(help="Comma-separated upstream base URLs (vllm/openai) (env FULMEN_UPSTREAM_URLS)."),
    ] = None,
    max_request_bytes: Annotated[
        int | None, typer.Option(help="Largest request body (env FULMEN_MAX_REQUEST_BYTES; 1 MiB).")
    ] = None,
    max_batch: Annotated[
        int | None, typer.Option(help="Most requests decoded together (torch) (env FULMEN_MAX_BATCH; 16).")
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="DEBUG, INFO, WARNING or ERROR (env FULMEN_LOG_LEVEL).")
    ] = None,
) -> None:
    """Serve an OpenAI-compatible API that records every LLM call as a span of its rollout attempt.

    Agents use http://<host>:<port>/rollout/<rollout id>/attempt/<attempt id>/v1 as their base URL
    (runners hand it out). API keys come only from the environment (FULMEN_PROXY_API_KEYS,
    FULMEN_UPSTREAM_API_KEY), never from a flag that `ps` would show."""
    try:
        settings = load_settings(
            experiment=experiment, proxy_host=proxy_host, proxy_port=proxy_port, proxy_public_url=proxy_public_url,
            proxy_backend=proxy_backend, model_dir=model_dir, model_name=model_name, upstream_urls=upstream_urls,
            max_request_bytes=max_request_bytes, max_batch=max_batch, log_level=log_level,
        )  # fmt: skip
    except FulmenError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from fulmen_llm_proxy.server import serve

    if settings.proxy_backend == "torch" and settings.model_dir is not None:
        from fulmen.model_versions import wait_for_model_dir

        wait_for_model_dir(settings.model_dir)  # the demo writes its model after the warm start
    try:
        serve(settings)
    except (OSError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
