"""Which model versions keep their weights: the newest ``keep`` ones, every one a live proxy or replica
serves, and the one the policy names (after `fulmen rollback`, an old one).

Entry point `retain_versions`; a kept delta keeps its chain. The rule and why: docs/design/model-versions.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from fulmen.keys import POLICY_RESOURCES_ID
from fulmen.store.redis_store import RedisStore  # not the package: its retention imports this module
from fulmen.versions.transport.file_spares import retire

log = logging.getLogger(__name__)

__all__ = ["record_stored", "retain_versions", "rewrite_aof_after_publish", "rewrite_aof_between_versions",
           "served_versions", "stored_versions", "versions_to_delete"]


async def record_stored(store: RedisStore, model_version: str, resources_version: int, base: str | None = None,
                        manifest: str | None = None) -> None:
    """``model_version`` is stored (published by ``resources_version``), a delta on ``base``, with
    ``manifest`` (JSON): kept through the AOF while its weights may not be, so a version whose
    chunks Redis lost can be rebuilt and checked (`fulmen.versions.rebuild`)."""
    async with store.redis.pipeline(transaction=True) as pipe:
        pipe.zadd(store.keys.stored_versions, {model_version: resources_version})
        if base is not None:
            pipe.hset(store.keys.version_bases, model_version, base)
        if manifest is not None:
            pipe.hset(store.keys.version_manifests, model_version, manifest)
        await pipe.execute()


async def stored_versions(store: RedisStore) -> list[str]:
    """Versions whose weights are kept, oldest first."""
    return [m.decode() if isinstance(m, bytes) else m for m in await store.redis.zrange(store.keys.stored_versions, 0, -1)]


async def retain_versions(store: RedisStore, keep: int, shared_dir: str | Path | None = None) -> list[str]:
    """Delete the weights of every stored version but the newest ``keep`` and those live proxies
    serve; returns the versions deleted, oldest first."""
    doomed = await versions_to_delete(store, keep)
    for version in doomed:
        # the weights first: a version still listed is deleted again by the next pass, never leaked
        await store.weights_redis.delete(store.keys.weights(version))
        async with store.redis.pipeline(transaction=True) as pipe:
            pipe.zrem(store.keys.stored_versions, version)
            pipe.hdel(store.keys.version_bases, version)
            pipe.hdel(store.keys.version_manifests, version)
            await pipe.execute()
        if shared_dir is not None:
            await asyncio.to_thread(retire, Path(shared_dir), version)
    if doomed:
        log.info("deleted the weights of %d old model version(s) (%s … %s); %d kept", len(doomed), doomed[0],
                 doomed[-1], await store.redis.zcard(store.keys.stored_versions))
    await rewrite_aof_between_versions(store)
    return doomed


async def rewrite_aof_between_versions(store: RedisStore, wait_s: float = 0.0, poll_s: float = 0.1) -> bool:
    """Start Redis's AOF rewrite if `fulmen.store.redis.aof`'s rule says it is due, once no version is on
    its way: every live proxy and replica serves the newest stored version (a rewrite would slow their
    reads). Waits up to ``wait_s`` for that (the trainer, right after a publish); whether a rewrite
    was started."""
    from fulmen.store.redis.aof import rewrite_if_grown

    deadline = time.monotonic() + wait_s
    while not await _versions_settled(store):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    started = await rewrite_if_grown(store.redis)
    if store.weights_redis is not store.redis:
        started = await rewrite_if_grown(store.weights_redis) or started
    return started


async def rewrite_aof_after_publish(store: RedisStore, wait_s: float = 60.0) -> None:
    """`rewrite_aof_between_versions` as a background task of the publisher: waits for the proxies
    to load the version just published; a failure is logged, never raised (nothing depends on it)."""
    try:
        await rewrite_aof_between_versions(store, wait_s)
    except Exception as e:  # Redis's own rule still bounds the file
        log.warning("could not check whether Redis's AOF needs a rewrite: %s: %s", type(e).__name__, e)


async def _versions_settled(store: RedisStore) -> bool:
    newest = await store.redis.zrange(store.keys.stored_versions, -1, -1)
    served = {p.model_version for p in await store.registry.query_proxies()} | {
        r.model_version for r in (await store.registry.query_replicas()).values()}
    return not newest or served <= {_text(newest[0])}


async def versions_to_delete(store: RedisStore, keep: int) -> list[str]:
    """The stored versions `retain_versions` would delete now, oldest first (deleting nothing: a
    dry run of `fulmen trim` lists them)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the newest version), got {keep}")
    stored = await stored_versions(store)
    served = await served_versions(store)
    bases = {_text(k): _text(v) for k, v in (await store.redis.hgetall(store.keys.version_bases)).items()}
    needed = set(stored[max(0, len(stored) - keep):]) | served
    for version in list(needed):
        while (version := bases.get(version)) is not None and version not in needed:  # type: ignore[assignment]
            needed.add(version)
    return [v for v in stored if v not in needed]


async def served_versions(store: RedisStore) -> set[str]:
    """The versions live proxies and replicas serve, and those the policy names (what proxies are
    about to load: an old one after a rollback, B of an A/B test)."""
    served = {p.model_version for p in await store.registry.query_proxies()} | {
        r.model_version for r in (await store.registry.query_replicas()).values() if r.model_version}
    return {v for v in served if v} | await _policy_versions(store)


async def _policy_versions(store: RedisStore) -> set[str]:
    """The versions the policy names: the served one, and B of an A/B test."""
    from fulmen.errors import NotFound

    try:
        update = await store.resources.get_resources(POLICY_RESOURCES_ID)
    except NotFound:
        return set()
    llm = update.resources.get("llm")
    if not isinstance(llm, dict):
        return set()
    b = (llm.get("ab") or {}).get("b") if isinstance(llm.get("ab"), dict) else None
    named = [llm.get("model_version"), b.get("model_version") if isinstance(b, dict) else None]
    return {v for v in named if isinstance(v, str)}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
