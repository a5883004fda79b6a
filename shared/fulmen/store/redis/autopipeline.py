"""Auto-pipelining: the script calls one process makes in the same loop iteration share a round trip."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError, ResponseError

from fulmen.store.redis.wire import Wire

log = logging.getLogger(__name__)

Call = tuple[AsyncScript, list[Any], "asyncio.Future[Any]"]  # a script, its arguments, its caller's future


class AutoPipeline:
    """Sends the script calls that the coroutines of one event loop make in the same loop iteration
    as one pipeline: one write and one round trip for all of them (ioredis's auto-pipelining).

    No call waits for another's round trip; a call made alone goes out alone, one loop iteration
    later. Under load, when several coroutines wake together (a runner with several rollouts in
    flight), they share one round trip, and redis-py's fixed CPU cost per round trip (more than the
    hot scripts themselves cost the server) is paid once.

    Once a round trip has gone through the client, the next ones go out on a connection of its own
    (`fulmen.store.redis.wire`), written and read in loop callbacks, one round trip at a time: the
    calls made while one is in flight go out together when it is answered. What the wire cannot
    carry (a lost connection's calls, NOSCRIPT) goes through the client again, in order.
    """

    # Most calls, and argument bytes, one joined call carries: a script blocks the server while it runs.
    MAX_JOINED = 64
    MAX_JOINED_BYTES = 1 << 20

    # After the client failed to hand over a connection for the wire, the next try waits this long.
    WIRE_RETRY_S = 1.0

    def __init__(self, redis: aioredis.Redis, prepare: Callable[[], Awaitable[None]] | None = None,
                 reload: Callable[[], Awaitable[None]] | None = None) -> None:
        """``prepare``: awaited before each round trip through the client (loading every script the
        calls may use, once). ``reload``: loads them all again after a NOSCRIPT reply (a restarted
        server): with only some of them loaded, calls made later on a key could run before the ones
        sent again."""
        self.redis = redis
        self.prepare = prepare
        self.reload = reload
        self._joined: dict[AsyncScript, AsyncScript] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued: list[Call] = []
        self._in_flight: set[asyncio.Task[None]] = set()  # strong references until sent
        # The wire (`fulmen.store.redis.wire`) carries one round trip at a time once a first one went
        # through the client (scripts prepared); calls made meanwhile wait in _queued for the next.
        self._wire: Wire | None = None
        self._wire_possible = True  # False for a client whose connections cannot be taken over
        self._wire_retry_at = 0.0
        self._wire_busy = False

    def join(self, script: AsyncScript, joined: AsyncScript) -> None:
        """Calls of ``script`` on the same key in one round trip go out as one call of ``joined``, its
        joined form (`fulmen.store.lua.scripts.joinable`), as `_joins` says: each call still gets its own
        reply, and runs after every call made before it on its key, as it would have alone."""
        self._joined[script] = joined

    def submit(self, script: AsyncScript, args: list[Any]) -> asyncio.Future[Any]:
        """Queue one EVALSHA of a lifecycle script: ``args[0]`` is its one key (KEYS[1], the experiment
        prefix), the rest its ARGV. The future resolves to its reply (or raises its error)."""
        loop = self._running_loop()
        if not self._queued:
            loop.call_soon(self._flush)
        future = loop.create_future()
        self._queued.append((script, args, future))
        return future

    async def on_wire(self, commands: list[tuple[Any, ...]]) -> list[Any] | None:
        """The replies of ``commands`` (each a command and its arguments), written in one write on the
        wire beside the script calls' round trips, error replies as exceptions; None where the wire
        cannot carry them (a cluster, no connection to take, one lost before the replies came): the
        caller then sends them through the client, so only commands safe to send twice belong here."""
        loop = self._running_loop()
        if self._wire is None or not self._wire.open:
            await self._take_wire()
        wire = self._wire
        if wire is None or not wire.open:
            return None
        future: asyncio.Future[list[Any] | None] = loop.create_future()
        try:
            wire.send(commands, partial(_resolve, future))
        except (TypeError, ValueError, OverflowError):  # an argument hiredis cannot pack: the client says which
            return None
        return await future

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop; used from a new one, what was queued on the old one died with it, and
        its wire is of no use here."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._queued, self._wire, self._wire_busy = loop, [], None, False
        return loop

    async def aclose(self) -> None:
        """Give the wire's connection back to the client (calls in flight on it go through the client)."""
        wire, self._wire = self._wire, None
        if wire is not None:
            await wire.close()

    def _flush(self) -> None:
        if self._wire_busy:  # the round trip in flight on the wire flushes these once answered
            return
        # A call whose caller was cancelled before it went out is not sent, as without batching.
        batch = [call for call in self._queued if not call[2].done()]
        self._queued = []
        if not batch:
            return
        wire = self._wire
        if wire is not None and wire.open:
            calls, members = self._joins(batch)
            try:
                wire.send([("EVALSHA", script.sha, 1, *args) for script, args in calls],
                          partial(self._answered, batch, calls, members))
            except (TypeError, ValueError, OverflowError):  # an argument hiredis cannot pack: redis-py says which
                pass
            else:
                self._wire_busy = True
                return
        self._start(self._send(batch))

    def _start(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    def _answered(self, batch: list[Call], calls: list[tuple[AsyncScript, list[Any]]], members: list[list[int]],
                  replies: list[Any] | None) -> None:
        """The wire's round trip for ``batch`` is over: settle it, or send again through the client what
        did not run (every call on a lost connection, the calls that found their script missing)."""
        if replies is None or any(isinstance(reply, NoScriptError) for reply in replies):
            self._start(self._send_again(batch, calls, members, replies))
            return
        self._wire_busy = False
        self._settle(batch, split_joined(replies, members))
        self._flush()

    async def _send_again(self, batch: list[Call], calls: list[tuple[AsyncScript, list[Any]]],
                          members: list[list[int]], replies: list[Any] | None) -> None:
        try:
            if replies is None:  # lost with the connection: sent again, as redis-py's retry would
                await self._drop_wire()
                replies = await evalsha_batch(self.redis, calls, self.reload)
            else:
                missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
                await (self.reload() if self.reload is not None else _load(self.redis, calls[missing[0]][0]))
                again = await evalsha_batch(self.redis, [calls[i] for i in missing], self.reload)
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
            self._settle(batch, split_joined(replies, members))
        except BaseException as e:
            self._fail(batch, e)
            if not isinstance(e, Exception):
                raise
        finally:
            self._wire_busy = False
            if self._queued:
                self._loop.call_soon(self._flush)  # type: ignore[union-attr]
        await self._take_wire()

    async def _send(self, batch: list[Call]) -> None:
        try:
            if self.prepare is not None:
                await self.prepare()
            calls, members = self._joins(batch)
            replies = split_joined(await evalsha_batch(self.redis, calls, self.reload), members)
        except BaseException as e:  # the connection failed: every call of the batch failed with it
            self._fail(batch, e)
            if not isinstance(e, Exception):
                raise
            return
        self._settle(batch, replies)
        await self._take_wire()

    @staticmethod
    def _settle(batch: list[Call], replies: list[Any]) -> None:
        for (_, _, future), reply in zip(batch, replies, strict=True):
            if future.done():  # its caller was cancelled; the call itself has run
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    @staticmethod
    def _fail(batch: list[Call], error: BaseException) -> None:
        for _, _, future in batch:
            if future.done():
                continue
            if isinstance(error, Exception):
                future.set_exception(error)
            else:  # the task was cancelled (the loop is closing): so are the calls
                future.cancel()

    async def _take_wire(self) -> None:
        """Take a connection for the wire after a round trip through the client went well."""
        loop = asyncio.get_running_loop()
        if self._wire is not None and not self._wire.open:  # lost while idle
            await self._drop_wire()
        if self._wire is not None or not self._wire_possible or loop.time() < self._wire_retry_at:
            return
        self._wire_retry_at = math.inf  # one try at a time
        wire: Wire | None = None
        try:
            wire = await Wire.take(self.redis)
        except (RedisError, OSError) as e:
            log.debug("no connection for the auto-pipeline's wire yet (%s)", e)
            return
        finally:  # a failed or cancelled try is made again later
            self._wire_retry_at = 0.0 if wire is not None else loop.time() + self.WIRE_RETRY_S
        if wire is None:
            self._wire_possible = False
        elif self._wire is not None or loop is not self._loop:  # taken meanwhile, or the loop changed
            await wire.close()
        else:
            self._wire = wire

    async def _drop_wire(self) -> None:
        wire, self._wire = self._wire, None
        if wire is not None:
            with contextlib.suppress(RedisError, OSError):  # it is gone either way
                await wire.close()

    def _joins(self, batch: list[Call]) -> tuple[list[tuple[AsyncScript, list[Any]]], list[list[int]]]:
        """The script calls to send for ``batch``, and the positions in ``batch`` of the calls each one
        carries. Calls of a joinable script on one key become one call of its joined form, sent where
        the first of them was, unless a call of another script on that key comes between them: each
        call then still runs after every earlier call on its key (calls on other keys touch none of its
        keys, so where it stands among them does not matter)."""
        if len(batch) == 1:  # the usual round trip at low load: nothing to join
            return [batch[0][:2]], [[0]]
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


def _resolve(future: asyncio.Future[Any], replies: list[Any] | None) -> None:
    if not future.done():  # its caller was cancelled meanwhile
        future.set_result(replies)


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
