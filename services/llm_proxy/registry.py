"""The proxy's entry in the store's proxy registry: its base URL, refreshed as a heartbeat.

Heartbeat well within `fulmen.store.registry.PROXY_TTL_S`; the metadata carries the control state.
More: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from fulmen.records import ProxyEndpoint
from fulmen.store import RedisStore

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
MAX_PROXY_ID = 128  # the store's id limit (`fulmen.keys.check_id`)


def default_proxy_id(base_url: str) -> str:
    """Stable across restarts of the same proxy (host and port), so a restart replaces its entry."""
    name = re.sub(r"[^A-Za-z0-9_.:\-]", "-", base_url.split("://", 1)[-1].rstrip("/"))
    return f"proxy-{name}"[:MAX_PROXY_ID]


def default_base_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()  # reachable from other machines, unlike the wildcard address
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class Registration:
    """Heartbeats the proxy's endpoint; `refresh` re-registers at once (a control state change)."""

    def __init__(
        self, store: RedisStore, proxy_id: str, base_url: str, describe: Callable[[], dict[str, Any]]
    ) -> None:
        self.store = store
        self.proxy_id = proxy_id
        self.base_url = base_url
        self.describe = describe  # -> {"model", "model_version", "metadata"}
        self._wake = asyncio.Event()

    def refresh(self) -> None:
        self._wake.set()

    async def register(self) -> None:
        d = self.describe()
        await self.store.registry.register_proxy(
            ProxyEndpoint(
                self.proxy_id, self.base_url, d["model"], d["model_version"], metadata=d["metadata"]
            )
        )

    async def run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.register()
            except (RedisError, OSError) as e:
                log.warning("could not register proxy %s: %s", self.proxy_id, e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), HEARTBEAT_S)

    async def unregister(self) -> None:
        try:
            await self.store.registry.unregister_proxy(self.proxy_id)
        except (RedisError, OSError) as e:
            log.warning("could not unregister proxy %s: %s", self.proxy_id, e)
