"""`fulmen llm-proxy`: the command; every option is also a FULMEN_<NAME> environment variable."""

from __future__ import annotations

from fulmen.cli.service import run_service, service_command
from fulmen.settings import ProxySettings
from fulmen_llm_proxy.main import SERVICE

# The proxy's flags keep their short historical names next to the settings' names.
NAMES = {
    "proxy_host": ("--host", "--proxy-host"),
    "proxy_port": ("--port", "--proxy-port"),
    "proxy_backend": ("--backend", "--proxy-backend"),
}


@service_command(SERVICE, also=("log_level",), names=NAMES)
def command(settings: ProxySettings) -> None:
    """Serve an OpenAI-compatible API that records every LLM call as a span of its rollout attempt.

    Agents use http://<host>:<port>/rollout/<rollout id>/attempt/<attempt id>/v1 as their base URL
    (runners hand it out). API keys come only from the environment (FULMEN_PROXY_API_KEYS,
    FULMEN_UPSTREAM_API_KEY), never from a flag that `ps` would show."""
    from fulmen_llm_proxy.server import loop_factory

    run_service(SERVICE, settings, loop_factory=loop_factory())
