"""The Redis transport: a version's blob as chunks on its weights stream (`fulmen.versions.blobs.write_stream`),
read back by `fulmen.versions.transport.stream`. The default of `publish_model_version`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fulmen.errors import InvalidInput
from fulmen.store.redis.aof import writing_weights
from fulmen.versions import blobs
from fulmen.versions.blobs import CHUNK_HEADER_BYTES

if TYPE_CHECKING:
    from fulmen.store import RedisStore
    from fulmen.versions.transport.base import Payload

CHUNK_BYTES = 4 << 20  # a stream entry's bytes, by default


@dataclass(frozen=True)
class RedisTransport:
    """Chunks of at most ``chunk_bytes`` on ``store.keys.weights(<version>)`` in ``store.weights_redis``."""

    chunk_bytes: int = CHUNK_BYTES

    def check(self, store: RedisStore) -> None:
        limit = store.max_record_bytes - CHUNK_HEADER_BYTES
        if not 0 < self.chunk_bytes <= limit:
            raise InvalidInput(
                f"chunk_bytes is {self.chunk_bytes:,}; it must be between 1 and {limit:,} (the store's "
                f"max_record_bytes {store.max_record_bytes:,} minus {CHUNK_HEADER_BYTES} for the record header)"
            )

    @contextlib.asynccontextmanager
    async def writing(self, store: RedisStore, payload: Payload) -> AsyncIterator[None]:
        # No AOF rewrite starts while the weights go to Redis, and one already running ends before the
        # first chunk (`fulmen.store.redis.aof`): meanwhile, the payload is hashed and serialised
        async with writing_weights(store.weights_redis) as rewrite_done:
            await payload.serialize()
            await rewrite_done()
            yield

    async def write(self, store: RedisStore, name: str, payload: Payload) -> dict[str, Any]:
        assert payload.blob is not None and payload.sha256 is not None  # serialised in `writing`
        return await blobs.write_stream(store, name, payload.blob, payload.sha256, self.chunk_bytes)

    async def delete(self, store: RedisStore, name: str) -> None:
        await store.weights_redis.delete(store.keys.weights(name))
