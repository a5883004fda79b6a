"""Dead letters: messages that could not be processed, kept with the reason for a person to look at."""

from __future__ import annotations

from collections.abc import Mapping

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
