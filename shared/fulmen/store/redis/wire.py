"""A Redis connection taken over from a client's pool for the auto-pipeline's script calls.

`Wire` writes a round trip's commands in one call and parses the replies as they arrive, in the
event loop's callbacks: no task, no await and none of redis-py's per-command machinery. The
auto-pipeline (`fulmen.store.redis.autopipeline`) falls back to the client for anything it cannot do.
Why: docs/design/store.md, "The auto-pipeline and its wire".
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import InvalidResponse

log = logging.getLogger(__name__)

# A round trip with no reply for this long means a dead connection (no FIN came: a host gone, a
# partition): it is dropped, and its calls go out again through the client, which reconnects.
STALL_S = 30.0

_NOT_ENOUGH = object()  # what the reader gives until a whole reply is in
Answered = Callable[[list[Any] | None], None]  # a round trip's replies in order, or None: connection lost


class Wire(asyncio.Protocol):
    """One connection of a client's pool (connected, authenticated, its database selected) whose
    transport now talks to this protocol: `send` writes commands, and each round trip's callback
    gets its replies, error replies as redis-py's exceptions (NOSCRIPT as `NoScriptError`)."""

    def __init__(self, pool: ConnectionPool, conn: AbstractConnection, transport: asyncio.Transport) -> None:
        self._pool, self._conn, self._transport = pool, conn, transport
        self._previous = transport.get_protocol()  # redis-py's stream protocol: told when the connection closes
        options: dict[str, Any] = {"protocolError": InvalidResponse, "notEnoughData": _NOT_ENOUGH,
                                   "replyError": conn._parser.parse_error}  # type: ignore[attr-defined]
        if conn.encoder.decode_responses:
            options.update(encoding=conn.encoder.encoding, errors=conn.encoder.encoding_errors)
        self._reader = hiredis.Reader(**options)
        self._waiting: deque[tuple[int, list[Any], Answered]] = deque()  # per round trip: replies due, so far, callback
        self._replies = 0  # replies read so far: the stall timer's sign of progress
        self._timer: asyncio.TimerHandle | None = None
        self.open = True
        transport.set_protocol(self)

    @classmethod
    async def take(cls, client: aioredis.Redis) -> Wire | None:
        """A connection of ``client``'s pool as a `Wire`; None where one cannot be taken over (a
        cluster routes each call itself; a connection of another kind or encoding is the client's)."""
        pool = getattr(client, "connection_pool", None)
        if isinstance(client, RedisCluster) or not isinstance(pool, ConnectionPool):
            return None
        # The wire's connection stays in use, on top of the pool's limit (redis-py's default is 100):
        # a caller's own concurrent commands may still use as many as before.
        pool.max_connections += 1
        try:
            conn = await pool.get_connection()
        except BaseException:
            pool.max_connections -= 1
            raise
        writer = getattr(conn, "_writer", None)
        transport = writer.transport if isinstance(writer, asyncio.StreamWriter) else None
        if (transport is None or transport.is_closing()
                or conn.encoder.encoding.lower().replace("-", "") != "utf8"):  # hiredis packs str as UTF-8
            await pool.release(conn)
            pool.max_connections -= 1
            return None
        return cls(pool, conn, transport)

    def send(self, commands: list[tuple[Any, ...]], answered: Answered) -> None:
        """Write ``commands`` (each a command and its arguments) in one write; ``answered`` gets their
        replies once the last one is read, or None if the connection is lost first. Raises what
        packing raises (an argument Redis cannot take) before anything is written."""
        data = b"".join([hiredis.pack_command(command) for command in commands])
        self._transport.write(data)
        self._waiting.append((len(commands), [], answered))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(STALL_S, self._check_progress, self._replies)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        waiting = self._waiting
        try:
            while waiting:
                due, replies, answered = waiting[0]
                while len(replies) < due:
                    reply = self._reader.gets()
                    if reply is _NOT_ENOUGH:
                        return
                    if isinstance(reply, hiredis.PushNotification):  # RESP3 pushes: none are asked for
                        continue
                    replies.append(reply)
                    self._replies += 1
                waiting.popleft()
                answered(replies)
        except InvalidResponse:
            log.warning("Redis sent a reply the auto-pipeline cannot parse; dropping its connection")
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, deque()
        for _, _, answered in waiting:
            answered(None)
        self._previous.connection_lost(exc)  # so that redis-py's disconnect, waiting for the close, returns

    def _check_progress(self, replies_then: int) -> None:
        self._timer = None
        if not self._waiting:
            return
        if self._replies == replies_then:
            log.warning("Redis answered nothing on the auto-pipeline's connection for %.0f s; reconnecting", STALL_S)
            self.open = False
            self._transport.abort()  # connection_lost then hands every round trip in flight back
        else:
            self._timer = asyncio.get_running_loop().call_later(STALL_S, self._check_progress, self._replies)

    async def close(self) -> None:
        """Close the connection and give it back to the pool (which connects it again when next used)."""
        self.open = False
        try:
            await self._conn.disconnect(nowait=True)
        finally:
            await self._pool.release(self._conn)
            self._pool.max_connections -= 1
