"""What every part of the store shares: the connection, the experiment's keys, the record size limit,
the auto-pipeline for hot scripts, and the streams (whose poison goes to the dead-letter stream)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from fulmen import keys as k
from fulmen.codec import DEFAULT_MAX_RECORD_BYTES
from fulmen.store.autopipeline import AutoPipeline
from fulmen.store.stream import Decode, Stream, T


@dataclass(eq=False)
class StoreContext:
    redis: aioredis.Redis
    experiment: str
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    keys: k.Keys = field(init=False)
    pipeline: AutoPipeline = field(init=False)  # the hot-path scripts go through it

    _registered: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.keys = k.Keys(self.experiment)
        self.pipeline = AutoPipeline(self.redis)

    async def register_experiment(self) -> None:
        """Add the experiment to the list of experiments (once per store; idempotent)."""
        if not self._registered:
            await self.redis.sadd(k.EXPERIMENTS, self.experiment)
            self._registered = True

    def forget_registration(self) -> None:
        """The experiment was deleted under this store: register it again on the next write."""
        self._registered = False

    def script(self, source: str) -> AsyncScript:
        return self.redis.register_script(source)

    async def each(self, script: AsyncScript, arg_lists: Sequence[list[Any]]) -> list[Any]:
        """Run ``script`` once per argument list, in one round trip with any other queued calls;
        raises the first error reply."""
        return list(await asyncio.gather(*[self.pipeline.submit(script, args) for args in arg_lists]))

    def stream(self, key: str, decode: Decode[T], group: str | None = None, group_start: str = "0") -> Stream[T]:
        """A `Stream` on one of this experiment's keys, dead-lettering into its dead-letter stream."""
        return Stream(self.redis, key, decode, group=group, dead_letters=self.keys.dead_letters,
                      group_start=group_start)
