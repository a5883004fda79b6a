"""The shared-folder transport: a version's blob as ``<shared_dir>/<version>/model.safetensors``, for a
folder every proxy mounts at the same path; read back by `fulmen.versions.blobs.read_file` (or
`fulmen.versions.transport.file_follow` while it is written).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulmen.versions import blobs
from fulmen.versions.transport.file_write import write_file_hashing

if TYPE_CHECKING:
    from fulmen.store import RedisStore
    from fulmen.versions.transport.base import Payload


@dataclass(frozen=True)
class FolderTransport:
    """Files in ``shared_dir``. A full or LoRA version is hashed while it is written (the file's header,
    which holds the hashes, is written last: `fulmen.versions.transport.file_write`); a version whose
    manifest is given (a delta) is serialised first. No weights go to Redis: no AOF rewrite to wait for."""

    shared_dir: str | Path

    def check(self, store: RedisStore) -> None:
        pass  # a file takes any size

    @contextlib.asynccontextmanager
    async def writing(self, store: RedisStore, payload: Payload) -> AsyncIterator[None]:
        if payload.manifest is not None:
            await payload.serialize()
        yield

    async def write(self, store: RedisStore, name: str, payload: Payload) -> dict[str, Any]:
        folder = Path(self.shared_dir)
        if payload.blob is None:  # hashed while written
            weights, payload.manifest = await asyncio.to_thread(
                write_file_hashing, folder, name, payload.state_dict, payload.fmt)
            return weights
        assert payload.sha256 is not None
        return await asyncio.to_thread(blobs.write_file, folder, name, payload.blob, payload.sha256)

    async def delete(self, store: RedisStore, name: str) -> None:
        # the name's stream too: `next_model_version` counts a name taken there as taken
        await store.weights_redis.delete(store.keys.weights(name))
        await asyncio.to_thread(shutil.rmtree, Path(self.shared_dir) / name, True)
