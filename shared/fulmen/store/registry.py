"""The registry of processes: runners (workers) report their status, LLM proxies announce their
base URL; both double as heartbeats. Runners pick a live proxy per rollout (`pick_proxy`)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from fulmen import keys as k
from fulmen.errors import RecordError
from fulmen.records import ProxyEndpoint, ReplicaState, Worker
from fulmen.store.context import StoreContext

PROXY_TTL_S = 15.0  # a proxy silent for longer is not handed to new attempts
_END_LOAD = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class Registry:
    """Part of the store: the workers, the LLM proxies and the inference replicas, as last reported."""

    def __init__(self, ctx: StoreContext) -> None:
        self.redis = ctx.redis
        self.keys = ctx.keys

    async def update_worker(
        self, worker_id: str, status: str = "idle", metadata: Mapping[str, Any] | None = None
    ) -> Worker:
        """Record a worker's status; doubles as its heartbeat."""
        worker = Worker(worker_id, status, time.time(), dict(metadata or {}))
        await self.redis.hset(self.keys.workers, worker_id, worker.to_wire())
        return worker

    async def query_workers(
        self,
        status: str | None = None,
        *,
        sort_by: Literal["worker_id", "last_heartbeat_time"] = "worker_id",
        descending: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[Worker]:
        """Workers as they last reported themselves, filtered by status, sorted and paginated."""
        raw = await self.redis.hgetall(self.keys.workers)
        workers = [
            w for w in (Worker.from_wire(v) for v in raw.values()) if status is None or w.status == status
        ]
        workers.sort(key=lambda w: (getattr(w, sort_by) or 0, w.worker_id), reverse=descending)
        return workers[offset : None if limit is None else offset + limit]

    async def register_proxy(self, endpoint: ProxyEndpoint) -> ProxyEndpoint:
        """Record (or refresh) a proxy; call it every few seconds as the proxy's heartbeat."""
        k.check_id("proxy_id", endpoint.proxy_id)
        endpoint = replace(endpoint, last_heartbeat_time=time.time())
        await self.redis.hset(self.keys.proxies, endpoint.proxy_id, endpoint.to_wire())
        return endpoint

    async def take_replica_load(self, url: str, ttl_s: float) -> bool:
        """Whether ``url`` may load a version now: one replica of the experiment loads at a time, so
        with several, the others serve meanwhile. Held until `end_replica_load` or for ``ttl_s`` (a
        vllm-sync that dies mid-load does not hold the others back for longer)."""
        taken = await self.redis.set(self.keys.replica_loading, url, nx=True, px=max(1, int(ttl_s * 1000)))
        return bool(taken) or await self.redis.get(self.keys.replica_loading) == url.encode()

    async def end_replica_load(self, url: str) -> None:
        """Let the next replica load (only if ``url`` still holds the turn)."""
        await self.redis.eval(_END_LOAD, 1, self.keys.replica_loading, url)

    async def set_replica(self, state: ReplicaState) -> ReplicaState:
        """Record what an inference server serves and whether it takes requests (its vllm-sync does)."""
        state = replace(state, updated_time=time.time())
        await self.redis.hset(self.keys.replicas, state.url, state.to_wire())
        return state

    async def query_replicas(self) -> dict[str, ReplicaState]:
        """Every inference server's state by URL; an unreadable entry is left out."""
        replicas = {}
        for raw in (await self.redis.hgetall(self.keys.replicas)).values():
            try:
                state = ReplicaState.from_wire(raw)
            except RecordError:
                continue
            replicas[state.url] = state
        return replicas

    async def unregister_proxy(self, proxy_id: str) -> None:
        await self.redis.hdel(self.keys.proxies, proxy_id)

    async def query_proxies(self, max_age_s: float | None = PROXY_TTL_S) -> list[ProxyEndpoint]:
        """Registered proxies sorted by id; with ``max_age_s``, only those that heartbeated lately.

        A record that cannot be read is skipped: one bad entry must not hide the healthy proxies."""
        now = time.time()
        proxies = []
        for raw in (await self.redis.hgetall(self.keys.proxies)).values():
            try:
                proxy = ProxyEndpoint.from_wire(raw)
            except RecordError:
                continue
            if max_age_s is None or now - (proxy.last_heartbeat_time or 0) <= max_age_s:
                proxies.append(proxy)
        return sorted(proxies, key=lambda p: p.proxy_id)


def pick_proxy(proxies: Sequence[ProxyEndpoint], rollout_id: str) -> ProxyEndpoint:
    """The proxy for a rollout: a stable hash of its id, so every attempt and turn of a rollout lands on
    the same proxy (its KV cache, its sticky upstream) while rollouts spread evenly.

    Rendezvous hashing: when a proxy joins or leaves, only the rollouts that hashed to it move."""
    if not proxies:
        raise ValueError("no proxy to pick from")

    def score(p: ProxyEndpoint) -> bytes:
        return hashlib.blake2b(f"{p.proxy_id}|{rollout_id}".encode(), digest_size=8).digest()

    return max(proxies, key=score)
