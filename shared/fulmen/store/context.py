"""What every part of the store shares: the connection, the experiment's keys, the record size limit,
the auto-pipeline for hot scripts, and the streams (whose poison goes to the dead-letter stream)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from fulmen import keys as k
from fulmen.codec import DEFAULT_MAX_RECORD_BYTES
from fulmen.store.redis.autopipeline import AutoPipeline
from fulmen.store.redis.stream import Decode, Stream, T


@dataclass(eq=False)
class StoreContext:
    redis: aioredis.Redis
    experiment: str
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    shards: int | None = None  # lifecycle shards (None: FULMEN_STORE_SHARDS, default 1)
    keys: k.Keys = field(init=False)
    pipeline: AutoPipeline = field(init=False)  # the hot-path scripts go through it

    _registered: bool = field(init=False, default=False)
    _scripts: list[AsyncScript] = field(init=False, default_factory=list)
    _scripts_loaded: bool = field(init=False, default=False)
    _loading: asyncio.Lock | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.keys = k.Keys(self.experiment, self.shards)
        self.pipeline = AutoPipeline(self.redis, self.load_scripts, self.reload_scripts)

    async def load_scripts(self) -> None:
        """Load every script of the store into the server (every master of a cluster), once, before
        the first auto-pipelined round trip. redis-py's cluster client mishandles concurrent NOSCRIPT
        replies (a connection goes back to its pool twice, and a script may run twice), and on any
        server a round trip whose calls find only some of their scripts loaded sends the others again
        after them, out of the order they were made in (calls on one key are joined and ordered:
        `fulmen.store.redis.autopipeline`). A server restarted since has lost them all: the auto-pipeline
        then reloads them all (`reload_scripts`); a direct call loads its own, one at a time."""
        if self._scripts_loaded:
            return
        if self._loading is None:
            self._loading = asyncio.Lock()
        async with self._loading:
            if not self._scripts_loaded:
                for script in self._scripts:
                    script.sha = await self.redis.script_load(script.script)
                self._scripts_loaded = True

    async def reload_scripts(self) -> None:
        """Load every script again (the server answered NOSCRIPT: it restarted or flushed them)."""
        self._scripts_loaded = False
        await self.load_scripts()

    async def register_experiment(self) -> None:
        """Add the experiment to the list of experiments (once per store; idempotent)."""
        if not self._registered:
            await self.redis.sadd(k.EXPERIMENTS, self.experiment)
            self._registered = True

    def forget_registration(self) -> None:
        """The experiment was deleted under this store: register it again on the next write."""
        self._registered = False

    def script(self, source: str) -> AsyncScript:
        script = self.redis.register_script(source)
        if isinstance(self.redis, RedisCluster):
            script = _ClusterScript(self, script)
        self._scripts.append(script)
        return script

    def joinable_script(self, source: str, joined: str) -> AsyncScript:
        """`script` for a script whose calls on one key the auto-pipeline sends as one call of
        ``joined``, its joined form (`fulmen.store.lua.scripts.joinable`)."""
        script = self.script(source)
        self.pipeline.join(script, self.script(joined))
        return script

    async def each(self, script: AsyncScript, arg_lists: Sequence[list[Any]]) -> list[Any]:
        """Run ``script`` once per argument list, in one round trip with any other queued calls;
        raises the first error reply."""
        return list(await asyncio.gather(*[self.pipeline.submit(script, args) for args in arg_lists]))

    def stream(self, key: str, decode: Decode[T], group: str | None = None, group_start: str = "0") -> Stream[T]:
        """A `Stream` on one of this experiment's keys, dead-lettering into its dead-letter stream."""
        return Stream(self.redis, key, decode, group=group, dead_letters=self.keys.dead_letters,
                      group_start=group_start)


class _ClusterScript(AsyncScript):
    """A script on a cluster: loaded into every master before its first call (`load_scripts`)."""

    def __init__(self, ctx: StoreContext, script: AsyncScript) -> None:
        self.registered_client, self.script, self.sha = script.registered_client, script.script, script.sha
        self._ctx = ctx

    async def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        await self._ctx.load_scripts()
        return await super().__call__(keys, args, client)
