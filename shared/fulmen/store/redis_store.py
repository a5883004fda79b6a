"""The store: Agent Lightning 0.3's LightningStore semantics on Redis Streams, as an async API.

`RedisStore` is composed of parts, one per noun, sharing one `StoreContext`: ``store.queue``,
``store.rollouts``, ``store.spans``, ``store.finished``, ``store.resources``, ``store.samples``,
``store.registry``, ``store.dead_letters``, ``store.validations``. One spelling per call; the parts:
docs/design/store.md.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from fulmen import keys as k
from fulmen.codec import DEFAULT_MAX_RECORD_BYTES
from fulmen.store.context import StoreContext
from fulmen.store.dead_letters import DeadLetters
from fulmen.store.finished import Finished
from fulmen.store.queue import DEFAULT_RECLAIM_IDLE_S, Queue
from fulmen.store.registry import Registry
from fulmen.store.resources import Resources
from fulmen.store.rollouts import FinishResult, Rollouts
from fulmen.store.samples import Samples
from fulmen.store.spans import Spans
from fulmen.store.statistics import aread_snapshot
from fulmen.store.validations import Validations

__all__ = ["FinishResult", "RedisStore"]


class RedisStore:
    """One experiment's store. Safe to share between coroutines; one per process is typical."""

    def __init__(
        self,
        redis: aioredis.Redis,
        experiment: str = "default",
        *,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        reclaim_idle_s: float = DEFAULT_RECLAIM_IDLE_S,
        shards: int | None = None,
        weights_redis: aioredis.Redis | None = None,
    ) -> None:
        """``shards``: the rollout lifecycle's shard count (`fulmen.keys`; None: FULMEN_STORE_SHARDS,
        default 1). Every process of an experiment must use the same: `ensure` checks it.
        ``weights_redis``: where model versions' weight chunks live (FULMEN_WEIGHTS_REDIS_URL,
        `fulmen.store.redis.connection.connect_weights`); None: ``redis``."""
        self.ctx = ctx = StoreContext(redis, experiment, max_record_bytes, shards)
        self.redis, self.keys, self.experiment, self.max_record_bytes = redis, ctx.keys, experiment, max_record_bytes
        self.weights_redis = weights_redis if weights_redis is not None else redis

        self.queue = queue = Queue(ctx, reclaim_idle_s)
        self.rollouts = rollouts = Rollouts(ctx, queue.ensure)
        self.spans = Spans(ctx)
        self.finished = Finished(ctx, rollouts)
        self.resources = Resources(ctx)
        self.samples = Samples(ctx)
        self.registry = Registry(ctx)
        self.dead_letters = DeadLetters(ctx)
        self.validations = Validations(ctx)

    def __repr__(self) -> str:
        return f"RedisStore(experiment={self.experiment!r})"

    async def aclose(self) -> None:
        await self.ctx.pipeline.aclose()
        await self.redis.aclose()

    async def statistics(self) -> dict[str, Any]:
        """One snapshot of the experiment: rollouts per status, queue depth, pending, dead letters
        (`fulmen.store.statistics`, which the metrics and `fulmen top` read too)."""
        await self.queue.ensure()
        def consumers_of_each_queue(pipe: Any) -> None:
            for shard in self.keys.shards:
                for queue in shard.queues:  # every priority lane
                    pipe.xinfo_consumers(queue, k.RUNNERS_GROUP)

        snap = await aread_snapshot(self.redis, self.keys, consumers_of_each_queue)
        pending: dict[str, int] = {}
        for reply in snap.extra:
            for c in [] if isinstance(reply, Exception) else reply:
                name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
                pending[name] = pending.get(name, 0) + int(c["pending"])
        latest = snap.latest_resources
        return {
            "experiment": self.experiment,
            "rollouts": snap.rollouts,
            "total_rollouts": sum(snap.rollouts.values()),
            "queue_depth": snap.queue_depth,
            "queue_depth_by_lane": snap.queue_depth_by_lane,
            "active_attempts": snap.active_attempts,
            "pending": pending,
            "heartbeat_watched": snap.heartbeat_watched,
            "dead_letters": snap.stream_lengths["dead_letters"],
            "finished": snap.stream_lengths["finished"],
            "latest_resources": None
            if latest is None
            else {"resources_id": latest.resources_id, "version": latest.version},
            "workers": snap.workers,
        }
