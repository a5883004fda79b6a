"""The Fulmen store: rollouts, attempts, spans and resources on Redis Streams."""

from fulmen.store.redis_store import FinishResult, RedisStore

__all__ = ["FinishResult", "RedisStore"]
