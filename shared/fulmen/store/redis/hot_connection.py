"""A client's every-call Redis commands (the proxy's replica checks, and the span writes that the
auto-pipeline's wire hands back to the client) on one connection.

redis-py's path for a command (pool checkout and release, retry wrapper, events, observability)
costs the proxy more CPU than building the span; `HotConnection` keeps one connection out of the
pool for them. Anything else, or a hot command while one is in flight, takes the client's path,
as does a hot command whose connection failed (it rides out an outage; the hot one reconnects).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

HOT_COMMANDS = frozenset({"EVALSHA", "HMGET"})  # one write and one reply each, never blocking


class HotConnection:
    """Runs `HOT_COMMANDS` of ``client`` on a connection of its own, one at a time (`install`)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._slow = client.execute_command
        self._callbacks = client.response_callbacks
        self._conn: AbstractConnection | None = None
        self._busy = False

    @classmethod
    def install(cls, client: aioredis.Redis) -> HotConnection:
        """Route ``client``'s hot commands through a new `HotConnection` (the store and the replica
        view call ``client.execute_command``, directly or through redis-py's command methods)."""
        hot = cls(client)
        client.execute_command = hot.execute_command  # type: ignore[method-assign]
        return hot

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        # ``keys`` names the keys for redis-py's client-side cache, which the proxy does not use
        if self._busy or args[0] not in HOT_COMMANDS or (options and options.keys() != {"keys"}):
            return await self._slow(*args, **options)
        conn = self._conn
        if conn is None:
            conn = self._conn = await self.client.connection_pool.get_connection()
        self._busy = True
        try:
            # As the client's path: a ping first when idle past the health check interval, a
            # reconnect when the last command lost the connection (redis-py then closed it).
            await conn.send_packed_command(conn.pack_command(*args))
            response = await conn.read_response()
        except (RedisConnectionError, RedisTimeoutError, OSError):
            # the client's path reconnects and rides out an outage (`fulmen.store.redis.connection`),
            # sending the command again as it would have after its own connection failed
            return await self._slow(*args, **options)
        finally:
            self._busy = False
        callback = self._callbacks.get(args[0])
        return callback(response) if callback is not None else response

    async def close(self) -> None:
        """Give the connection back to the client's pool (closed with the client)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await self.client.connection_pool.release(conn)
