"""The Fulmen store: rollouts, attempts, spans and resources on Redis Streams."""

from fulmen.store.redis_store import FinishResult, RedisStore
from fulmen.watchdog import run_watchdog, sweep

__all__ = ["FinishResult", "RedisStore", "run_watchdog", "sweep"]
