"""Resources: immutable, versioned snapshots (prompt templates, the LLM endpoint, a model version)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from fulmen import keys as k
from fulmen.errors import InvalidInput, NotFound, RecordError
from fulmen.records import ResourcesUpdate
from fulmen.store.context import StoreContext
from fulmen.store.lua import data as data_scripts
from fulmen.store.redis.stream import Fields, Stream, entry_id_text

log = logging.getLogger(__name__)

LATEST_PAGE = 16  # log entries read per round trip while looking back past unreadable ones


@dataclass(frozen=True)
class UnreadableVersion:
    """A stored version of a resources entry that no reader decodes: where it is (``key``, the field
    ``version``), its bytes as stored and why it is refused."""

    key: str
    version: str
    record: bytes
    reason: str


class Resources:
    """Part of the store: publishing, reading and following resources versions."""

    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx
        self.redis = ctx.redis
        self.keys = ctx.keys
        self.max_record_bytes = ctx.max_record_bytes
        self.log: Stream[ResourcesUpdate] = ctx.stream(ctx.keys.resources_log, self._decode)
        self._publish = ctx.script(data_scripts.PUBLISH_RESOURCES)

    def _decode(self, entry_id: str, fields: Fields) -> ResourcesUpdate:
        return ResourcesUpdate.from_wire(fields.get(b"m"), self.max_record_bytes)

    async def add_resources(
        self,
        resources: Mapping[str, Any],
        resources_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ResourcesUpdate:
        """Publish a new immutable snapshot under a new id. The id must not exist yet."""
        return await self._publish_resources(resources, resources_id, metadata, new_id=True)

    async def update_resources(
        self, resources_id: str, resources: Mapping[str, Any], metadata: Mapping[str, Any] | None = None
    ) -> ResourcesUpdate:
        """Publish a new version of ``resources_id``; earlier versions stay readable, unchanged."""
        return await self._publish_resources(resources, resources_id, metadata, new_id=False)

    async def _publish_resources(
        self,
        resources: Mapping[str, Any],
        resources_id: str | None,
        metadata: Mapping[str, Any] | None,
        new_id: bool,
    ) -> ResourcesUpdate:
        await self.ctx.register_experiment()
        if resources_id is not None:
            k.check_id("resources_id", resources_id)
        # Compare-and-set on the version counter (PUBLISH_RESOURCES) so versions enter the log in
        # order ("latest" is the log's tail): one script in the experiment's slot, where a WATCH
        # transaction would not work through a cluster client.
        while True:
            version = int(await self.redis.get(self.keys.resources_version) or 0) + 1
            rid = resources_id or f"res-{version}"
            update = ResourcesUpdate(rid, version, dict(resources), time.time(), dict(metadata or {}))
            record = update.to_wire(self.max_record_bytes)
            self._check_readable(rid, record)
            code = await self._publish(keys=[self.keys.prefix], args=[rid, version, record, int(new_id)])
            if code == b"exists":
                raise InvalidInput(f"resources {rid} exist already; publish a new version with update_resources")
            if code == b"ok":
                return update
            # another publisher took this version: read the counter again

    def _check_readable(self, resources_id: str, record: bytes) -> None:
        """InvalidInput unless ``record`` decodes as every reader decodes it (`ResourcesUpdate.from_wire`
        and its value checks): an entry the readers refuse, once published, would stop them all."""
        try:
            ResourcesUpdate.from_wire(record, self.max_record_bytes)
        except RecordError as e:
            raise InvalidInput(f"resources {resources_id} cannot be published: {e}") from None

    async def get_resources(self, resources_id: str, version: int | None = None) -> ResourcesUpdate:
        """A snapshot by id: its latest version, or the given one."""
        key = self.keys.resources(resources_id)
        if version is None:
            version = int(await self.redis.hget(key, "latest") or 0)
        record = await self.redis.hget(key, str(version)) if version else None
        if record is None:
            raise NotFound(f"resources {resources_id} (version {version or 'latest'}) do not exist")
        return ResourcesUpdate.from_wire(record, self.max_record_bytes)

    async def get_readable_resources(self, resources_id: str) -> tuple[ResourcesUpdate | None, list[UnreadableVersion]]:
        """The newest version of ``resources_id`` that decodes (None if there is none, or no entry) and
        the newer ones that do not, newest first (written by hand or by a foreign writer, as
        `get_resources` would refuse them): for a writer that replaces them rather than stop on them.
        Looks back at most LATEST_PAGE versions past the latest."""
        key = self.keys.resources(resources_id)
        try:
            return await self.get_resources(resources_id), []
        except NotFound:
            return None, []
        except (RecordError, ValueError):  # an unreadable latest version, or "latest" itself
            pass
        fields = await self.redis.hkeys(key)
        versions = sorted((int(f) for f in fields if f.isdigit()), reverse=True)[:LATEST_PAGE]
        unreadable: list[UnreadableVersion] = []
        for version in versions:
            record = await self.redis.hget(key, str(version))
            try:
                return ResourcesUpdate.from_wire(record, self.max_record_bytes), unreadable
            except RecordError as e:
                unreadable.append(UnreadableVersion(key, str(version), record or b"", str(e)))
        return None, unreadable

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        """The newest readable snapshot on the log. Entries that do not decode (garbage written to
        the log by hand or by a foreign writer) are passed over with a log line: a poisoned tail must
        not stop every rollout that runs with the latest resources."""
        before = "+"
        while True:
            page = await self.redis.xrevrange(self.keys.resources_log, max=before, count=LATEST_PAGE)
            for raw_id, fields in page:
                update = self._decode_or_skip(raw_id, fields)
                if update is not None:
                    return update
            if len(page) < LATEST_PAGE:
                return None
            before = "(" + entry_id_text(page[-1][0])

    def _decode_or_skip(self, raw_id: bytes | str, fields: Fields) -> ResourcesUpdate | None:
        try:
            return self._decode(entry_id_text(raw_id), fields)
        except RecordError as e:
            log.warning("skipping %s entry %s: %s", self.keys.resources_log, entry_id_text(raw_id), e)
            return None

    async def query_resources(
        self, *, limit: int | None = None, offset: int = 0, descending: bool = False
    ) -> list[ResourcesUpdate]:
        """The readable snapshots on the log, oldest first (unreadable entries are left out)."""
        entries = await self.redis.xrange(self.keys.resources_log)
        updates = [u for raw_id, f in entries if (u := self._decode_or_skip(raw_id, f)) is not None]
        if descending:
            updates.reverse()
        return updates[offset : None if limit is None else offset + limit]

    async def subscribe_resources(self, after_version: int | None = None) -> AsyncIterator[ResourcesUpdate]:
        """Yield every resources version published after ``after_version`` (default: from now on)."""
        async for _, update in self.log.follow("0-0" if after_version is not None else None):
            if after_version is None or update.version > after_version:
                yield update
