"""Auto-pipelining: the script calls one process makes in the same loop iteration share a round trip."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError


class AutoPipeline:
    """Sends the script calls that the coroutines of one event loop make in the same loop iteration
    as one pipeline: one write and one round trip for all of them (ioredis's auto-pipelining).

    No call waits for another's round trip; a call made alone goes out alone, one loop iteration
    later. Under load, when several coroutines wake together (a runner with several rollouts in
    flight), they share one round trip, and redis-py's fixed CPU cost per round trip (more than the
    hot scripts themselves cost the server) is paid once.
    """

    # Most calls, and argument bytes, one joined call carries: a script blocks the server while it runs.
    MAX_JOINED = 64
    MAX_JOINED_BYTES = 1 << 20

    def __init__(self, redis: aioredis.Redis, prepare: Callable[[], Awaitable[None]] | None = None,
                 reload: Callable[[], Awaitable[None]] | None = None) -> None:
        """``prepare``: awaited before each round trip (loading every script the calls may use, once).
        ``reload``: loads them all again after a NOSCRIPT reply (a restarted server): with only some
        of them loaded, calls made later on a key could run before the ones sent again."""
        self.redis = redis
        self.prepare = prepare
        self.reload = reload
        self._joined: dict[AsyncScript, AsyncScript] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued: list[tuple[AsyncScript, list[Any], asyncio.Future[Any]]] = []
        self._in_flight: set[asyncio.Task[None]] = set()  # strong references until sent

    def join(self, script: AsyncScript, joined: AsyncScript) -> None:
        """Calls of ``script`` on the same key in one round trip go out as one call of ``joined``, its
        joined form (`fulmen.store.lua.scripts.joinable`), as `_joins` says: each call still gets its own
        reply, and runs after every call made before it on its key, as it would have alone."""
        self._joined[script] = joined

    def submit(self, script: AsyncScript, args: list[Any]) -> asyncio.Future[Any]:
        """Queue one EVALSHA of a lifecycle script: ``args[0]`` is its one key (KEYS[1], the experiment
        prefix), the rest its ARGV. The future resolves to its reply (or raises its error)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # used from a new loop: what was queued on the old one died with it
            self._loop, self._queued = loop, []
        if not self._queued:
            loop.call_soon(self._flush)
        future = loop.create_future()
        self._queued.append((script, args, future))
        return future

    def _flush(self) -> None:
        # A call whose caller was cancelled before it went out is not sent, as without batching.
        batch = [call for call in self._queued if not call[2].done()]
        self._queued = []
        if not batch:
            return
        task = asyncio.ensure_future(self._send(batch))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _send(self, batch: list[tuple[AsyncScript, list[Any], asyncio.Future[Any]]]) -> None:
        try:
            if self.prepare is not None:
                await self.prepare()
            calls, members = self._joins(batch)
            replies = split_joined(await evalsha_batch(self.redis, calls, self.reload), members)
        except BaseException as e:  # the connection failed: every call of the batch failed with it
            for _, _, future in batch:
                if future.done():
                    continue
                if isinstance(e, Exception):
                    future.set_exception(e)
                else:  # this task was cancelled (the loop is closing): so are the calls
                    future.cancel()
            if not isinstance(e, Exception):
                raise
            return
        for (_, _, future), reply in zip(batch, replies, strict=True):
            if future.done():  # its caller was cancelled; the call itself has run
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def _joins(self, batch: list[tuple[AsyncScript, list[Any], asyncio.Future[Any]]]) -> tuple[list[tuple[AsyncScript, list[Any]]], list[list[int]]]:
        """The script calls to send for ``batch``, and the positions in ``batch`` of the calls each one
        carries. Calls of a joinable script on one key become one call of its joined form, sent where
        the first of them was, unless a call of another script on that key comes between them: each
        call then still runs after every earlier call on its key (calls on other keys touch none of its
        keys, so where it stands among them does not matter)."""
        members: list[list[int]] = []
        sizes: list[int] = []  # argument bytes of each group
        open_group: dict[Any, int] = {}  # key -> index in members of the group a call on it may join
        for i, (script, args, _) in enumerate(batch):
            key = args[0]
            joinable = script in self._joined
            size = sum(len(a) for a in args if isinstance(a, (bytes, str))) if joinable else 0
            group = open_group.get(key)
            if (group is not None and batch[members[group][0]][0] is script
                    and len(members[group]) < self.MAX_JOINED and sizes[group] + size <= self.MAX_JOINED_BYTES):
                members[group].append(i)
                sizes[group] += size
                continue
            members.append([i])
            sizes.append(size)
            if joinable:
                open_group[key] = len(members) - 1
            else:
                open_group.pop(key, None)
        calls: list[tuple[AsyncScript, list[Any]]] = []
        for group in members:
            script, args, _ = batch[group[0]]
            if len(group) == 1:
                calls.append((script, args))
                continue
            joined_args: list[Any] = [args[0]]
            for i in group:
                joined_args += [len(batch[i][1]) - 1, *batch[i][1][1:]]
            calls.append((self._joined[script], joined_args))
        return calls, members


def split_joined(replies: list[Any], members: list[list[int]]) -> list[Any]:
    """One reply per call of the batch, in the batch's order, from the replies of `AutoPipeline._joins`'
    calls: a joined call's reply is its calls' replies; its error, every one of theirs."""
    out: list[Any] = [None] * sum(len(group) for group in members)
    for reply, group in zip(replies, members, strict=True):
        if len(group) == 1:
            out[group[0]] = reply
            continue
        if not isinstance(reply, Exception) and (not isinstance(reply, list) or len(reply) != len(group)):
            reply = ResponseError(f"a joined script call answered {reply!r} for {len(group)} calls")
        for n, i in enumerate(group):
            out[i] = reply if isinstance(reply, Exception) else reply[n]
    return out


async def evalsha_batch(redis: aioredis.Redis, calls: list[tuple[AsyncScript, list[Any]]],
                        reload: Callable[[], Awaitable[None]] | None = None) -> list[Any]:
    """Run each (script, args) in one round trip; the replies in order, an error reply as its exception.
    ``args[0]`` is the script's one key (on a cluster, what routes the call), the rest its ARGV.

    Not ``script(client=pipeline)``: redis-py then sends SCRIPT EXISTS before every pipeline, a
    second round trip on the hot path. A NOSCRIPT reply (server restarted or flushed its script
    cache) means that call did not run, so loading the script and sending those calls again is safe;
    ``reload`` (if given) loads every script then, not only the missing ones.
    """
    if len(calls) == 1:  # no pipeline object for a call made alone
        script, args = calls[0]
        try:
            try:
                return [await redis.execute_command("EVALSHA", script.sha, 1, *args)]
            except NoScriptError:
                await (reload() if reload is not None else _load(redis, script))
                return [await redis.execute_command("EVALSHA", script.sha, 1, *args)]
        except ResponseError as e:
            return [e]
    pipe = redis.pipeline(transaction=False)
    for script, args in calls:
        pipe.execute_command("EVALSHA", script.sha, 1, *args)  # cluster pipelines refuse .evalsha
    replies = await pipe.execute(raise_on_error=False)
    missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
    if missing:
        if reload is not None:
            await reload()
        else:
            for script in {calls[i][0] for i in missing}:
                await _load(redis, script)
        pipe = redis.pipeline(transaction=False)
        for i in missing:
            pipe.execute_command("EVALSHA", calls[i][0].sha, 1, *calls[i][1])
        for i, reply in zip(missing, await pipe.execute(raise_on_error=False), strict=True):
            replies[i] = reply
    return replies


async def _load(redis: aioredis.Redis, script: AsyncScript) -> None:
    script.sha = await redis.script_load(script.script)
