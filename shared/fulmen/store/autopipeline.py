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

    # Most calls one joined call carries: a script blocks the server while it runs.
    MAX_JOINED = 64

    def __init__(self, redis: aioredis.Redis, prepare: Callable[[], Awaitable[None]] | None = None) -> None:
        """``prepare``: awaited before each round trip (a cluster's script loading; None on one node)."""
        self.redis = redis
        self.prepare = prepare
        self._joined: dict[AsyncScript, AsyncScript] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued: list[tuple[AsyncScript, list[Any], asyncio.Future[Any]]] = []
        self._in_flight: set[asyncio.Task[None]] = set()  # strong references until sent

    def join(self, script: AsyncScript, joined: AsyncScript) -> None:
        """Calls of ``script`` on the same key that are next to each other in a round trip go out as
        one call of ``joined``, its joined form (`fulmen.store.scripts.joinable`): each call still gets
        its own reply, and runs in the order it was made, as it would have alone."""
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
            calls, sizes = self._joins(batch)
            replies = split_joined(await evalsha_batch(self.redis, calls), sizes)
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

    def _joins(self, batch: list[tuple[AsyncScript, list[Any], asyncio.Future[Any]]]) -> tuple[list[tuple[AsyncScript, list[Any]]], list[int]]:
        """The script calls to send for ``batch``: runs of adjacent calls of a joinable script on one
        key become one call of its joined form. ``sizes``: how many calls of the batch each one
        carries (0: a call sent as it is)."""
        calls: list[tuple[AsyncScript, list[Any]]] = []
        sizes: list[int] = []
        i = 0
        while i < len(batch):
            script, args, _ = batch[i]
            end = i + 1
            if script in self._joined:
                while (end < len(batch) and end - i < self.MAX_JOINED and batch[end][0] is script
                       and batch[end][1][0] == args[0]):
                    end += 1
            if end - i == 1:
                calls.append((script, args))
                sizes.append(0)
            else:
                joined_args: list[Any] = [args[0]]
                for _, call_args, _ in batch[i:end]:
                    joined_args += [len(call_args) - 1, *call_args[1:]]
                calls.append((self._joined[script], joined_args))
                sizes.append(end - i)
            i = end
        return calls, sizes


def split_joined(replies: list[Any], sizes: list[int]) -> list[Any]:
    """One reply per call of the batch from the replies of `AutoPipeline._joins`' calls: a joined
    call's reply is its calls' replies; its error, every one of theirs."""
    out: list[Any] = []
    for reply, size in zip(replies, sizes, strict=True):
        if size == 0:
            out.append(reply)
        elif isinstance(reply, Exception):
            out += [reply] * size
        elif not isinstance(reply, list) or len(reply) != size:
            error = ResponseError(f"a joined script call answered {reply!r} for {size} calls")
            out += [error] * size
        else:
            out += reply
    return out


async def evalsha_batch(redis: aioredis.Redis, calls: list[tuple[AsyncScript, list[Any]]]) -> list[Any]:
    """Run each (script, args) in one round trip; the replies in order, an error reply as its exception.
    ``args[0]`` is the script's one key (on a cluster, what routes the call), the rest its ARGV.

    Not ``script(client=pipeline)``: redis-py then sends SCRIPT EXISTS before every pipeline, a
    second round trip on the hot path. A NOSCRIPT reply (server restarted or flushed its script
    cache) means that call did not run, so loading the script and sending those calls again is safe.
    """
    if len(calls) == 1:
        script, args = calls[0]
        try:
            return [await script(keys=args[:1], args=args[1:])]  # no pipeline object for a call made alone
        except ResponseError as e:
            return [e]
    pipe = redis.pipeline(transaction=False)
    for script, args in calls:
        pipe.execute_command("EVALSHA", script.sha, 1, *args)  # cluster pipelines refuse .evalsha
    replies = await pipe.execute(raise_on_error=False)
    missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
    if missing:
        for script in {calls[i][0] for i in missing}:
            script.sha = await redis.script_load(script.script)
        pipe = redis.pipeline(transaction=False)
        for i in missing:
            pipe.execute_command("EVALSHA", calls[i][0].sha, 1, *calls[i][1])
        for i, reply in zip(missing, await pipe.execute(raise_on_error=False), strict=True):
            replies[i] = reply
    return replies
