"""What each upstream inference server serves, as its `fulmen vllm-sync` last recorded it.

Calls go only to ready replicas; a changed ``generation`` marks a call "uncertain". How no sample
mixes two versions: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from fulmen.records import ReplicaState
from fulmen.store import RedisStore
from fulmen_llm_proxy.backends.upstream.upstreams import normalize

log = logging.getLogger(__name__)

REFRESH_S = 0.5


@dataclass(frozen=True)
class Stamp:
    """The replica's version and generation when a call was sent (None: no vllm-sync records it)."""

    url: str
    state: ReplicaState | None


class ReplicaView:
    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.states: dict[str, ReplicaState] = {}

    async def refresh(self) -> None:
        self.states = {normalize(url): state for url, state in (await self.store.registry.query_replicas()).items()}

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(REFRESH_S)

    def routable(self, url: str) -> bool:
        state = self.states.get(url)
        return state is None or state.ready

    def stamp(self, url: str) -> Stamp:
        return Stamp(url, self.states.get(url))

    async def confirm(self, stamp: Stamp) -> str | None:
        """The version that served a call sent under ``stamp``, or None if the weights may have
        changed while it ran."""
        # the url vllm-sync recorded, or any it may record for this replica when it was untracked
        urls = [stamp.state.url] if stamp.state is not None else [stamp.url, f"{stamp.url}/v1", f"{stamp.url}/"]
        raw = next((r for r in await self.store.redis.hmget(self.store.keys.replicas, urls) if r is not None), None)
        now = ReplicaState.from_wire(raw) if raw is not None else None
        if stamp.state is None and now is None:
            return ""  # untracked upstream: the backend's own default version
        # untracked when sent and tracked now: its vllm-sync started meanwhile and may have loaded
        if stamp.state is None or now is None or now.generation != stamp.state.generation or not stamp.state.ready:
            return None
        return stamp.state.model_version
