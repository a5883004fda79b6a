"""One Redis stream and, optionally, one consumer group on it: the only place that speaks XREADGROUP,
XACK, XAUTOCLAIM and the follow-with-XREAD loop. Every stream consumer in Fulmen goes through it.

Read as a group (`read`, `ack`, `reclaim`, `dead_letter`) or as a broadcast (`follow`).
More: docs/design/store.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ResponseError

from fulmen.errors import RecordError, RecordTooLarge
from fulmen.records import DeadLetter

log = logging.getLogger(__name__)

T = TypeVar("T")
Fields = Mapping[bytes, bytes]
Decode = Callable[[str, Fields], T]

DEFAULT_READ_COUNT = 100  # entries per read when the caller names no count
# The longest a read blocks. A client with a socket timeout (redis-py's default is 5 s) must not take
# a long block for a dead connection, and a follower must notice a dead connection within seconds.
MAX_BLOCK_S = 0.5
DEAD_LETTER_PAYLOAD_BYTES = 65536  # of each raw field kept in a dead letter, enough to diagnose it
DEAD_LETTER_REASON_CHARS = 4096  # a reason quoting the bad value could be as large as the value
# A dead letter whose fields would exceed the record size limit keeps this much of them in all.
DEAD_LETTER_TRUNCATED_BYTES = DeadLetter.MAX_BYTES // 4
DEAD_LETTER_NAME_CHARS = 256  # of each field's name, in a truncated dead letter


def block_ms(block_s: float | None) -> int | None:
    """A read's BLOCK argument: None (do not block) or at least 1 ms (0 would block forever)."""
    return None if block_s is None else max(1, int(block_s * 1000))


def entry_id_text(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


class Stream(Generic[T]):
    """A stream ``key``, read through ``decode``; with ``group``, as that consumer group.

    Safe to share between coroutines. The group is created once per object (not before every read:
    that would cost a round trip each time); a group deleted since (the experiment was deleted) makes
    a read fail with NOGROUP, and the group is created again and the read repeated."""

    def __init__(
        self,
        redis: aioredis.Redis,
        key: str,
        decode: Decode[T],
        *,
        group: str | None = None,
        dead_letters: str | None = None,
        group_start: str = "0",
    ) -> None:
        self.redis = redis
        self.key = key
        self.decode = decode
        self.group = group
        self.dead_letters = dead_letters
        self.group_start = group_start
        self.group_ready = False
        self._reclaim_cursor: bytes | str = "0-0"

    def __repr__(self) -> str:
        return f"Stream({self.key!r}, group={self.group!r})"

    # --- consumer group ---------------------------------------------------------------------------

    def _group(self) -> str:
        if self.group is None:
            raise TypeError(f"{self!r} has no consumer group")
        return self.group

    async def ensure_group(self, start: str | None = None) -> None:
        """Create the group (and the stream) if missing; an existing group is left as it is."""
        try:
            await self.redis.xgroup_create(self.key, self._group(), id=start or self.group_start, mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self.group_ready = True

    async def recover(self, error: ResponseError) -> None:
        """After a read failed: create the group again if it is gone (NOGROUP), else raise ``error``."""
        if "NOGROUP" not in str(error):
            raise error
        log.warning("consumer group %s on %s was gone; created it again", self.group, self.key)
        self.group_ready = False
        await self.ensure_group()

    async def read(
        self,
        consumer: str,
        count: int = DEFAULT_READ_COUNT,
        block_s: float | None = None,
        *,
        pending: bool = False,
        after: str = "0",
    ) -> list[tuple[str, T]]:
        """New entries for ``consumer`` (blocking up to ``block_s``; None: not at all), decoded.

        ``pending``: instead, the entries this consumer read before and has not acknowledged (after
        a restart under the same name), oldest first, from the one after ``after``: page on with the
        last id read, since entries that stay pending are returned again from "0"."""
        if not self.group_ready:
            await self.ensure_group()
        streams = {self.key: after if pending else ">"}
        block = None if pending else block_ms(block_s)
        try:
            reply = await self.redis.xreadgroup(self._group(), consumer, streams, count=count, block=block)
        except ResponseError as e:
            await self.recover(e)
            reply = await self.redis.xreadgroup(self._group(), consumer, streams, count=count, block=block)
        return await self.decode_entries(reply[0][1] if reply else [])

    async def decode_entries(self, entries: Sequence[Any]) -> list[tuple[str, T]]:
        """Raw group entries as (id, record); an entry that does not decode is dead-lettered."""
        out = []
        for raw_id, fields in entries:
            entry_id = entry_id_text(raw_id)
            try:
                out.append((entry_id, self.decode(entry_id, fields)))
            except RecordError as e:
                await self.dead_letter(entry_id, str(e), fields)
        return out

    async def ack(self, entry_ids: Sequence[str]) -> int:
        return await self.redis.xack(self.key, self._group(), *entry_ids) if entry_ids else 0

    async def reclaim(self, consumer: str, min_idle_ms: int, count: int = DEFAULT_READ_COUNT) -> list[tuple[str, T]]:
        """Take over up to ``count`` entries pending longer than ``min_idle_ms`` in other consumers
        (they died holding them), decoded. Each call goes on from where the last one stopped and
        wraps around at the end, so entries that cannot be claimed never hide live ones behind them.

        XAUTOCLAIM's reply is (next cursor, entries[, deleted ids]): Redis 7 adds the third element
        and drops deleted entries; Redis 6.2 returns a deleted entry as nil (or with nil fields).
        Both are skipped: a deleted entry has nothing to process."""
        try:
            reply = await self.redis.xautoclaim(
                self.key, self._group(), consumer, min_idle_ms, self._reclaim_cursor, count=count
            )
        except ResponseError as e:
            await self.recover(e)
            return []
        self._reclaim_cursor = reply[0]
        entries = [e for e in reply[1] if e and e[0] is not None and e[1] is not None]
        if entries:
            log.warning("took over %d entries of %s left pending by a dead consumer", len(entries), self.key)
        return await self.decode_entries(entries)

    async def dead_letter(self, entry_id: str, reason: str, fields: Fields) -> None:
        """Move an entry that can never be processed to the dead-letter stream with ``reason``, and
        acknowledge it (in the same MULTI) so the group moves on."""
        if self.dead_letters is None:
            raise TypeError(f"{self!r} has no dead-letter stream")
        reason = reason[:DEAD_LETTER_REASON_CHARS]
        log.error("dead-lettered %s entry %s: %s", self.key, entry_id, reason)
        payload = {_field_name(name): value[:DEAD_LETTER_PAYLOAD_BYTES] for name, value in fields.items()}
        try:
            record = DeadLetter(self.key, entry_id, reason, payload, time.time()).to_wire()
        except RecordTooLarge:
            # Many large fields: keep what fits of them, and say so, rather than fail here (the
            # consumer would die on the entry, and again after each restart).
            record = _truncated_letter(self.key, entry_id, reason, payload).to_wire()
        # One MULTI when both keys share a slot; a stream of another shard acknowledges after the
        # letter is written (a crash in between dead-letters the entry again, never loses it).
        same_slot = key_slot(self.key.encode()) == key_slot(self.dead_letters.encode())
        pipe = self.redis.pipeline(transaction=same_slot)
        pipe.xadd(self.dead_letters, {"m": record})
        if self.group is not None and same_slot:
            pipe.xack(self.key, self.group, entry_id)
        await pipe.execute()
        if self.group is not None and not same_slot:
            await self.redis.xack(self.key, self.group, entry_id)

    # --- broadcast --------------------------------------------------------------------------------

    async def last(self) -> tuple[str, Fields] | None:
        """The newest entry, raw (id, fields), or None if the stream is empty."""
        reply = await self.redis.xrevrange(self.key, count=1)
        return (entry_id_text(reply[0][0]), reply[0][1]) if reply else None

    async def last_id(self) -> str:
        """The newest entry's id ("0-0" if none): a cursor for "from now on". Not "$", which would
        move on with every read and miss what arrives between two reads."""
        last = await self.last()
        return last[0] if last else "0-0"

    async def cursor(self, after: str | None = None) -> Cursor[T]:
        """A reader of the entries after ``after`` (None: after the newest one now)."""
        return Cursor(self, after if after is not None else await self.last_id())

    async def follow(
        self, after: str | None = None, *, count: int = DEFAULT_READ_COUNT
    ) -> AsyncIterator[tuple[str, T]]:
        """Every entry after ``after`` (None: from now on), decoded, forever."""
        cursor = await self.cursor(after)
        while True:
            for item in await cursor.read(MAX_BLOCK_S, count):
                yield item


def _field_name(name: bytes | str) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _truncated_letter(source: str, entry_id: str, reason: str, payload: Mapping[str, bytes]) -> DeadLetter:
    """A dead letter that fits the size limit: the first fields, each cut to an equal share of
    `DEAD_LETTER_TRUNCATED_BYTES`, as many as fit, and the reason saying what was left out."""
    share = max(DEAD_LETTER_NAME_CHARS, DEAD_LETTER_TRUNCATED_BYTES // max(1, len(payload)))
    kept: dict[str, bytes] = {}
    used = 0
    for name, value in payload.items():
        if used + share > DEAD_LETTER_TRUNCATED_BYTES:
            break
        kept[name[:DEAD_LETTER_NAME_CHARS]] = value[:share]
        used += share
    total = sum(len(n) + len(v) for n, v in payload.items())
    note = (f" [dead letter truncated: kept {len(kept)} of {len(payload)} fields, "
            f"at most {share} bytes each, of {total} bytes]")
    return DeadLetter(source, entry_id, reason + note, kept, time.time())


class Cursor(Generic[T]):
    """One reader's position on a broadcast stream: each `read` returns what was added after it."""

    def __init__(self, stream: Stream[T], after: str) -> None:
        self.stream = stream
        self.after = after

    async def read(self, block_s: float | None = MAX_BLOCK_S, count: int = DEFAULT_READ_COUNT) -> list[tuple[str, T]]:
        """The entries after the cursor, decoded, waiting up to ``block_s`` (at most `MAX_BLOCK_S`,
        so a dead connection is noticed) for one to arrive; [] if none did. Undecodable entries are
        skipped with a log line: a broadcast has no group to dead-letter for."""
        wait = None if block_s is None else min(block_s, MAX_BLOCK_S)
        reply = await self.stream.redis.xread({self.stream.key: self.after}, count=count, block=block_ms(wait))
        out = []
        for raw_id, fields in reply[0][1] if reply else []:
            entry_id = entry_id_text(raw_id)
            self.after = entry_id
            try:
                out.append((entry_id, self.stream.decode(entry_id, fields)))
            except RecordError as e:
                log.warning("skipping %s entry %s: %s", self.stream.key, entry_id, e)
        return out
