"""The run's own fields in the store: what a restarted algorithm reads to continue where it was.

The `Scheduler` keeps its position (epoch, cursor, groups, enqueued) in the same hash; these are the
fields the run loop adds, and the set of rollouts counted as done.
"""

from __future__ import annotations

from fulmen.store import RedisStore

# The version at which the next validation pass is due (absent: 0, the starting weights).
NEXT_VALIDATION = "next_val"


class RunProgress:
    """Named access to the run's fields of the algorithm's state hash (``keys.algorithm_state``)."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store

    async def next_validation(self) -> int:
        return int(await self.store.redis.hget(self.store.keys.algorithm_state, NEXT_VALIDATION) or 0)

    async def set_next_validation(self, version: int) -> None:
        await self.store.redis.hset(self.store.keys.algorithm_state, NEXT_VALIDATION, version)

    async def rollouts_done(self) -> int:
        """Train rollouts of the run counted as finished (over the whole run, restarts included)."""
        return int(await self.store.redis.scard(self.store.keys.algorithm_done))
