"""The store: Agent Lightning 0.3's LightningStore semantics on Redis Streams, as an async API.

`RedisStore` is composed of parts, one per noun, sharing one `StoreContext`; every public method of a
part is also a method of the store, under the same name. The parts: docs/design/store.md.
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
        self.ensure = queue.ensure
        self.dequeue_rollouts = queue.dequeue_rollouts
        self.dequeue_rollout = queue.dequeue_rollout

        self.rollouts = rollouts = Rollouts(ctx, queue.ensure)
        self.new_rollout = rollouts.new_rollout
        self.enqueue_rollouts = rollouts.enqueue_rollouts
        self.enqueue_rollout = rollouts.enqueue_rollout
        self.start_rollout = rollouts.start_rollout
        self.start_attempt = rollouts.start_attempt
        self.update_attempt = rollouts.update_attempt
        self.expire_attempt = rollouts.expire_attempt
        self.update_rollout = rollouts.update_rollout
        self.release_attempt = rollouts.release_attempt
        self.cancel_rollout = rollouts.cancel_rollout
        self.get_rollout = rollouts.get_rollout
        self.get_rollouts = rollouts.get_rollouts
        self.get_attempt = rollouts.get_attempt
        self.get_latest_attempt = rollouts.get_latest_attempt
        self.query_attempts = rollouts.query_attempts
        self.query_rollouts = rollouts.query_rollouts

        self.spans = spans = Spans(ctx)
        self.add_spans = spans.add_spans
        self.add_span = spans.add_span
        self.heartbeat = spans.heartbeat
        self.query_spans = spans.query_spans

        self.finished = finished = Finished(ctx, rollouts)
        self.wait_for_rollouts = finished.wait_for_rollouts
        self.ensure_finished_group = finished.ensure_finished_group
        self.read_finished = finished.read_finished
        self.ack_finished = finished.ack_finished
        self.reclaim_finished = finished.reclaim_finished
        self.dead_letter_finished = finished.dead_letter_finished

        self.resources = resources = Resources(ctx)
        self.add_resources = resources.add_resources
        self.update_resources = resources.update_resources
        self.get_resources = resources.get_resources
        self.get_latest_resources = resources.get_latest_resources
        self.query_resources = resources.query_resources
        self.subscribe_resources = resources.subscribe_resources

        self.samples = samples = Samples(ctx)
        self.read_for_samples = samples.read_for_samples
        self.append_samples = samples.append_samples
        self.adapter_stats = samples.adapter_stats
        self.ensure_samples_group = samples.ensure_samples_group
        self.read_samples = samples.read_samples
        self.ack_samples = samples.ack_samples
        self.dead_letter_samples = samples.dead_letter_samples

        self.registry = registry = Registry(ctx)
        self.update_worker = registry.update_worker
        self.query_workers = registry.query_workers
        self.register_proxy = registry.register_proxy
        self.unregister_proxy = registry.unregister_proxy
        self.query_proxies = registry.query_proxies
        self.set_replica = registry.set_replica
        self.query_replicas = registry.query_replicas

        self.dead_letters = dead_letters = DeadLetters(ctx)
        self.dead_letter = dead_letters.dead_letter
        self.query_dead_letters = dead_letters.query_dead_letters
        self.requeue_dead_letter = dead_letters.requeue_dead_letter

    def __repr__(self) -> str:
        return f"RedisStore(experiment={self.experiment!r})"

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def statistics(self) -> dict[str, Any]:
        """One snapshot of the experiment: rollouts per status, queue depth, pending, dead letters
        (`fulmen.store.statistics`, which the metrics and `fulmen top` read too)."""
        await self.ensure()
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
