"""What each upstream inference server serves, as its `fulmen vllm-sync` last recorded it.

Calls go only to ready replicas; a changed ``generation`` marks a call "uncertain", and so does a
replica recorded during a call sent while it was not. How no sample mixes two versions:
docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from fulmen.records import ReplicaState
from fulmen.records.messages import TRACKING_GRACE_S
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
        self.read_at = -math.inf  # when the registry was read for ``states`` (monotonic)

    async def refresh(self) -> None:
        read_at = time.monotonic()
        self.states = {normalize(url): state for url, state in (await self.store.registry.query_replicas()).items()}
        self.read_at = read_at

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
        if stamp.state is None:
            return await self._confirm_untracked(stamp.url)
        raw = await self.store.redis.hget(self.store.keys.replicas, stamp.state.url)
        now = ReplicaState.from_wire(raw) if raw is not None else None
        if now is None or now.generation != stamp.state.generation or not stamp.state.ready:
            return None
        return stamp.state.model_version

    async def _confirm_untracked(self, url: str) -> str | None:
        """A call sent to a replica no vllm-sync had recorded: "" (the backend's own default version),
        or None if one has recorded it since, and so may have loaded weights during the call."""
        if url in self.states:
            return None
        if time.monotonic() - self.read_at < TRACKING_GRACE_S:
            return ""  # read after any vllm-sync that could have loaded since the call left recorded it
        # the view is older than that (a stalled refresh): ask the registry, under any url it may use
        urls = [url, f"{url}/v1", f"{url}/"]
        stored = await self.store.redis.hmget(self.store.keys.replicas, urls)
        return "" if all(r is None for r in stored) else None
