"""What a transport is: where `publish_model_version` writes a version's bytes (`Transport`), and what
it writes (`Payload`). The two ways: `fulmen.versions.transport.redis`, `fulmen.versions.transport.folder`.
Why one interface: docs/design/model-versions.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fulmen.versions import blobs
from fulmen.versions.manifest import Manifest, describe_all

if TYPE_CHECKING:
    import torch

    from fulmen.store import RedisStore


@dataclass
class Payload:
    """A version's tensors as a publish writes them: ``fmt`` (full or LoRA) names the manifest computed
    for them unless one is given (a delta's); `serialize` fills in the blob and its sha256, or a
    transport that hashes while it writes sets ``manifest`` itself."""

    state_dict: Mapping[str, torch.Tensor]
    fmt: str
    manifest: Manifest | None = None
    blob: blobs.Blob | None = None
    sha256: str | None = None

    async def serialize(self) -> None:
        """The manifest (unless given), the blob and its sha256, each computed in a thread."""
        if self.manifest is None:
            self.manifest = Manifest(self.fmt, None, await asyncio.to_thread(describe_all, self.state_dict))
        self.blob = await asyncio.to_thread(blobs.serialize, self.state_dict, self.manifest)
        self.sha256 = await asyncio.to_thread(blobs.blob_sha256, self.blob, self.manifest)


class Transport(Protocol):
    """Where a version's bytes go. `publish_model_version` calls, in order: `check`, then inside
    `writing`, `write` under each name until one is free; `delete` frees a name never published."""

    def check(self, store: RedisStore) -> None:
        """InvalidInput for what ``store`` cannot take, before anything is written."""
        ...

    def writing(self, store: RedisStore, payload: Payload) -> AbstractAsyncContextManager[None]:
        """Around the writes; on entry ``payload`` is ready to `write` (serialised where this transport
        needs it first) and the store is ready to take it."""
        ...

    async def write(self, store: RedisStore, name: str, payload: Payload) -> dict[str, Any]:
        """The payload written as version ``name``: its ``weights`` entry. VersionTaken if the name is in
        use; nothing left behind on any failure."""
        ...

    async def delete(self, store: RedisStore, name: str) -> None:
        """Free ``name``, whose weights no resources version names (a publish killed half-way)."""
        ...
