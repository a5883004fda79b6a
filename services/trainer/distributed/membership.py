"""Trainer rank membership: rank n is a Redis key held with a TTL and refreshed by a heartbeat.

A process takes the lowest free rank. A rank counts as live (gets a share of each step) only once it
has marked itself ready (model loaded, reading plans); a rank whose key expires is gone. See
`fulmen_trainer.distributed.rank_group` for what the leader does about a rank that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

from fulmen.store import RedisStore

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
CLAIM_WAIT_S = 60.0  # how long a new process waits for a free rank before giving up
READY = ":ready"  # suffix of a held rank's value once the process reads plans
EXIT_RANK_TAKEN = 3  # exit code: another process took this rank while we were silent
# KEYS[1] = the rank's key, ARGV[1] = our token, ARGV[2] = TTL ms. Returns 1 if we hold the rank
# (refreshed, or taken back after a pause long enough to let it expire), 0 if another process has it.
# Our token marked ready counts as ours: `mark_ready` writes it just before it keeps it as its token.
_REFRESH = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] or holder == ARGV[1] .. ':ready' then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if not holder then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]); return 1 end
return 0
"""



class Membership:
    """This process's trainer rank, held as a Redis key with a TTL, and who else is live."""

    def __init__(self, store: RedisStore, world_size: int, timeout_s: float) -> None:
        self.store = store
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.timeout_ms = int(timeout_s * 1000)
        self.token = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.rank: int | None = None
        self._refresh = store.redis.register_script(_REFRESH)

    async def claim(self, wait_s: float = CLAIM_WAIT_S) -> int:
        """Take the lowest free rank (waiting while all are held)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank in range(self.world_size):
                if await self.store.redis.set(self.store.keys.trainer_slot(rank), self.token, nx=True, px=self.timeout_ms):
                    self.rank = rank
                    log.info("holding trainer rank %d of %d", rank, self.world_size)
                    return rank
            if time.monotonic() > deadline:
                raise RuntimeError(f"all {self.world_size} trainer ranks are taken; raise FULMEN_WORLD_SIZE")
            await asyncio.sleep(HEARTBEAT_S)

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            assert self.rank is not None
            key = self.store.keys.trainer_slot(self.rank)
            try:
                if not await self._refresh(keys=[key], args=[self.token, self.timeout_ms]):
                    log.error("trainer rank %d was taken by another process while we were silent; stopping",
                              self.rank)
                    os._exit(EXIT_RANK_TAKEN)  # two rank-n processes would corrupt the run
            except Exception as e:
                log.warning("rank heartbeat failed: %s", e)

    async def mark_ready(self) -> None:
        """Count in the live ranks from now on (model loaded, reading plans). Until then the leader
        does not hand this rank a share it could not compute in time."""
        assert self.rank is not None
        ready = self.token + READY
        await self.store.redis.set(self.store.keys.trainer_slot(self.rank), ready, px=self.timeout_ms)
        self.token = ready

    async def live(self) -> list[int]:
        """Ranks held by a process that is ready."""
        pipe = self.store.redis.pipeline(transaction=False)
        for rank in range(self.world_size):
            pipe.get(self.store.keys.trainer_slot(rank))
        return [r for r, value in enumerate(await pipe.execute()) if value and value.decode().endswith(READY)]

    async def release(self) -> None:
        if self.rank is not None:
            key = self.store.keys.trainer_slot(self.rank)
            if (await self.store.redis.get(key) or b"").decode() == self.token:  # still ours
                await self.store.redis.delete(key)
