"""Dead letters: messages that could not be processed, kept with the reason for a person to look at."""

from __future__ import annotations

from collections.abc import Mapping

from redis.crc import key_slot

from fulmen.errors import InvalidInput, NotFound
from fulmen.records import DeadLetter
from fulmen.store.context import StoreContext

DEAD_LETTERS_READ = 100  # dead letters a query returns unless asked for another number


def _raw(entry_id: str, fields: Mapping[bytes, bytes]) -> Mapping[bytes, bytes]:
    return fields


class DeadLetters:
    """Part of the store: moving a poison entry of any stream aside, and listing what was moved."""

    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx

    async def dead_letter(
        self, source: str, entry_id: str, reason: str, fields: Mapping[bytes, bytes], ack_group: str | None = None
    ) -> None:
        """Move entry ``entry_id`` of stream ``source`` aside with ``reason``; with ``ack_group``,
        acknowledge it there in the same step so that group moves on (`Stream.dead_letter`)."""
        await self.ctx.stream(source, _raw, group=ack_group).dead_letter(entry_id, reason, fields)

    async def query_dead_letters(self, limit: int = DEAD_LETTERS_READ) -> list[DeadLetter]:
        """The newest dead letters first."""
        entries = await self.ctx.redis.xrevrange(self.ctx.keys.dead_letters, count=limit)
        return [DeadLetter.from_wire(f[b"m"], dead_letter_id=eid.decode()) for eid, f in entries]

    async def requeue_dead_letter(self, dead_letter_id: str) -> str:
        """Put a dead letter's entry back on the stream it came from (a new entry, as it was, for the
        consumers to try again once the cause is fixed) and remove it from the dead letters, in one
        MULTI. Returns the new entry's id. Only streams of this experiment are written to."""
        entries = await self.ctx.redis.xrange(self.ctx.keys.dead_letters, dead_letter_id, dead_letter_id)
        if not entries:
            raise NotFound(f"dead letter {dead_letter_id} does not exist in experiment {self.ctx.experiment}")
        letter = DeadLetter.from_wire(entries[0][1].get(b"m"), dead_letter_id=dead_letter_id)
        own = any(letter.source.startswith(shard.prefix) for shard in self.ctx.keys.shards)
        if not own or not letter.payload:
            raise InvalidInput(f"dead letter {dead_letter_id} cannot be requeued (source {letter.source!r})")
        kind = await self.ctx.redis.type(letter.source)
        if kind not in (b"stream", b"none", "stream", "none"):  # a stream trimmed away comes back as one
            # e.g. an unreadable resources entry, set aside from its hash: there is no stream to put
            # it back on (an XADD would fail inside the MULTI and the letter would go with nothing back)
            raise InvalidInput(f"dead letter {dead_letter_id} came from {letter.source!r}, not a stream but a "
                               f"{kind.decode() if isinstance(kind, bytes) else kind}: it stays for a person to "
                               "read, and cannot be requeued")
        # One MULTI when the source shares the dead letters' slot (shard 0); a stream of another
        # shard on a cluster cannot join it: the entry goes back first, then the letter goes.
        same_slot = key_slot(letter.source.encode()) == key_slot(self.ctx.keys.dead_letters.encode())
        pipe = self.ctx.redis.pipeline(transaction=same_slot)
        pipe.xadd(letter.source, dict(letter.payload))
        pipe.xdel(self.ctx.keys.dead_letters, dead_letter_id)
        new_id, _ = await pipe.execute()
        return new_id.decode() if isinstance(new_id, bytes) else str(new_id)
