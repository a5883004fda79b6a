"""vllm-sync's end of a weight group (``weight_group``): the server's workers join the trainer's group
once, and each full version is then received straight into their weights, no folder between.

The trainer advertises its rendezvous in the store; this asks it to make a group (``join``) and, per
version, to send (``send``), while the workers wait for it over ``/collective_rpc``. A version the
trainer says it holds (`ahead`) can be received before it is announced, while its folder is written.
The design: docs/design/vllm-sync.md.
"""

from __future__ import annotations

import logging
import time
import uuid

from fulmen.records import WeightGroupAction, WeightGroupAsk
from fulmen.store import RedisStore
from fulmen.versions.model_version import ModelVersion
from fulmen.versions.transport.group_asks import Rendezvous, advertised, ask, held
from fulmen_vllm_sync.admin import AdminError, VllmAdmin

log = logging.getLogger(__name__)


class GroupUnavailable(Exception):
    """No group to receive over now (no trainer advertises one): the version comes from a folder."""


class WeightGroup:
    def __init__(self, store: RedisStore, admin: VllmAdmin, url: str, timeout_s: float) -> None:
        self.store = store
        self.admin = admin
        self.by = f"vllm-sync {url}"
        self.timeout_s = timeout_s
        self.name: str | None = None  # the group the server's workers are in
        self.world_size = 0
        self.joined: Rendezvous | None = None  # the trainer's rendezvous the group was made at
        self.said_unadvertised = False
        self.tried_ahead: str | None = None  # the held version last received ahead of its announcement

    async def ahead(self, announced: str | None, served: str) -> str | None:
        """The full version the trainer holds to send when it is newer than both the newest ``announced``
        and the ``served`` one (its folder is still being written), and was not tried ahead already."""
        version = await held(self.store)
        if version is None or version == self.tried_ahead:
            return None
        number = ModelVersion.parse(version).number
        newest = max(ModelVersion.parse(announced).number, ModelVersion.parse(served).number)
        return version if number > newest else None

    async def join(self) -> None:
        """Put the server's workers in a new group with the trainer's rank 0 (GroupUnavailable when no
        trainer serves one; AdminError when the join fails)."""
        where = await advertised(self.store)
        if where is None:
            if not self.said_unadvertised:
                log.warning("weight_group is on but no trainer advertises a weight group (is it running with "
                            "FULMEN_WEIGHT_GROUP=true?): versions load from folders until one does")
                self.said_unadvertised = True
            raise GroupUnavailable("no trainer advertises a weight group")
        self.said_unadvertised = False
        world_size = 1 + await self.admin.workers()
        name = f"vs-{uuid.uuid4().hex[:12]}"
        await ask(self.store, WeightGroupAsk(WeightGroupAction.JOIN, name, world_size, "", self.by, time.time()))
        await self.admin.join_group(where.host, where.port, world_size, name, where.backend, self.timeout_s)
        self.name, self.world_size, self.joined = name, world_size, where
        log.info("%s joined the weight group %s at %s:%d (%d members)", self.by, name, where.host, where.port,
                 world_size)

    async def ready(self) -> None:
        """Be in a group with the trainer that advertises one now: joined again when none was joined, or
        the advertisement changed since (the trainer restarted: its groups are gone), before a load
        pauses the server; GroupUnavailable when no trainer advertises one."""
        if self.name is not None and await advertised(self.store) == self.joined:
            return
        self.name = None
        await self.join()

    async def receive(self, version: str) -> str:
        """Ask for ``version`` and receive it into the workers' weights (the server paused); the version
        that arrived (the trainer's newest full one: ``version`` or a later one). On failure the group is
        left, so the next version joins a new one."""
        if self.name is None:
            await self.join()
        assert self.name is not None
        try:
            await ask(self.store, WeightGroupAsk(WeightGroupAction.SEND, self.name, self.world_size, version, self.by,
                                                 time.time()))
            results = await self.admin.receive_group(self.timeout_s)
        except AdminError:
            self.name = None
            raise
        arrived = {str(r.get("version")) for r in results if isinstance(r, dict)}
        if len(arrived) != 1 or len(results) != self.world_size - 1:
            self.name = None
            raise AdminError(f"the workers received {sorted(arrived)} from the weight group, not one version each")
        return arrived.pop()
