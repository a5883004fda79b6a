"""The completions stream (every rollout that reached a terminal status, once) and dead letters."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from fulmen.errors import NotFound, RecordError
from fulmen.keys import Keys
from fulmen.records import Completion, DeadLetter, Rollout
from fulmen.status import TERMINAL_ROLLOUT

log = logging.getLogger(__name__)


class CompletionsMixin:
    """Part of `RedisStore`: waiting on, reading and acknowledging completions; dead letters."""

    redis: aioredis.Redis
    keys: Keys
    experiment: str
    _completion_groups: set[str]
    get_rollouts: Callable[[Sequence[str]], Awaitable[list[Rollout | None]]]

    async def _last_completion_id(self) -> str:
        last = await self.redis.xrevrange(self.keys.completions, count=1)
        return last[0][0].decode() if last else "0-0"

    async def wait_for_rollouts(
        self, rollout_ids: Sequence[str], timeout_s: float | None = None
    ) -> list[Rollout]:
        """Block (on the completions stream, no polling) until every rollout is terminal or the
        timeout passes. Returns the rollouts that are terminal, in the order asked."""
        cursor = await self._last_completion_id()  # read before the statuses: nothing slips between
        current = await self.get_rollouts(rollout_ids)
        missing = [rid for rid, r in zip(rollout_ids, current, strict=True) if r is None]
        if missing:
            raise NotFound(f"rollouts {missing[:5]} do not exist in experiment {self.experiment}")
        waiting = {r.rollout_id for r in current if r is not None and r.status not in TERMINAL_ROLLOUT}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            # at most 0.5 s per read: a client with a socket timeout (redis-py's default is 5 s) must not
            # take a long wait for a dead connection
            if deadline is None:
                block_ms = 500
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                block_ms = max(1, int(min(remaining, 0.5) * 1000))
            reply = await self.redis.xread({self.keys.completions: cursor}, count=1000, block=block_ms)
            for entry_id, fields in reply[0][1] if reply else []:
                cursor = entry_id.decode()
                try:
                    waiting.discard(Completion.from_wire(fields.get(b"m")).rollout_id)
                except RecordError:
                    continue  # not ours to dead-letter: the consumer groups do that
        finished = await self.get_rollouts(rollout_ids)
        return [r for r in finished if r is not None and r.status in TERMINAL_ROLLOUT]

    async def ensure_completions_group(self, group: str, start: str = "0") -> None:
        try:
            await self.redis.xgroup_create(self.keys.completions, group, id=start, mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._completion_groups.add(group)

    async def read_completions(
        self, group: str, consumer: str, count: int = 100, block_s: float | None = None, *, pending: bool = False
    ) -> list[Completion]:
        """Completions for a consumer group (the adapter, the algorithm). Acknowledge each with
        `ack_completions` once its effect is stored; malformed entries are dead-lettered here.
        ``pending``: instead, the entries this consumer read before and has not acknowledged (after a
        restart under the same consumer name), oldest first; acknowledge them to move on."""
        # The group is created once per store, not before every read (one more round trip each
        # time). A group deleted since (the experiment was deleted) makes the read fail (NOGROUP;
        # fakeredis words it otherwise): create the group again and read once more.
        ensured = group in self._completion_groups
        if not ensured:
            await self.ensure_completions_group(group)
        block_ms = None if block_s is None or pending else max(1, int(block_s * 1000))
        streams = {self.keys.completions: "0" if pending else ">"}
        try:
            reply = await self.redis.xreadgroup(group, consumer, streams, count=count, block=block_ms)
        except ResponseError:
            if not ensured:
                raise
            await self.ensure_completions_group(group)
            reply = await self.redis.xreadgroup(group, consumer, streams, count=count, block=block_ms)
        out = []
        for entry_id, fields in reply[0][1] if reply else []:
            try:
                out.append(Completion.from_wire(fields.get(b"m"), entry_id.decode()))
            except RecordError as e:
                await self.dead_letter(
                    self.keys.completions, entry_id.decode(), str(e), fields, ack_group=group
                )
        return out

    async def ack_completions(self, group: str, entry_ids: Sequence[str]) -> int:
        return await self.redis.xack(self.keys.completions, group, *entry_ids) if entry_ids else 0

    # --- dead letters -------------------------------------------------------------------------------

    async def dead_letter(
        self,
        source: str,
        entry_id: str,
        reason: str,
        fields: Mapping[bytes, bytes],
        ack_group: str | None = None,
    ) -> None:
        """Move a poison message aside with the reason, and acknowledge it so its queue moves on."""
        log.error("dead-lettered %s entry %s: %s", source, entry_id, reason)
        payload = {
            (name.decode(errors="replace") if isinstance(name, bytes) else str(name)): value[:65536]
            for name, value in fields.items()
        }
        letter = DeadLetter(source, entry_id, reason, payload, time.time())
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.keys.dead_letters, {"m": letter.to_wire()})
        if ack_group:
            pipe.xack(source, ack_group, entry_id)
        await pipe.execute()

    async def query_dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        entries = await self.redis.xrevrange(self.keys.dead_letters, count=limit)
        return [DeadLetter.from_wire(f[b"m"], dead_letter_id=eid.decode()) for eid, f in entries]
