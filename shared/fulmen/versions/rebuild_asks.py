"""Asking for a lost model version: the weights-rebuilds stream between who waits for a version
(a proxy, vllm-sync) and who can rebuild it (the trainer, from its checkpoint).

`ask_rebuild` and `wait_for_answer` for the waiting side, `answer_asks` for the rebuilding one
(through the rebuilders consumer group: an ask made while no trainer ran is answered when one
starts). The rebuild itself: `fulmen.versions.rebuild`; the design: docs/design/model-versions.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fulmen import keys as k
from fulmen.errors import InvalidInput
from fulmen.records import RebuildAction, VersionRebuild
from fulmen.store.redis.stream import Stream

if TYPE_CHECKING:
    from fulmen.store import RedisStore

log = logging.getLogger(__name__)

__all__ = ["announce_rebuilt", "answer_asks", "ask_rebuild", "wait_for_answer"]

MAX_ENTRIES = 1000  # the stream is capped: asks and answers matter for minutes, not for the run
ASKS_PER_READ = 16


def _stream(store: RedisStore) -> Stream[VersionRebuild]:
    return Stream(store.redis, store.keys.version_rebuilds, _decode, group=k.REBUILDERS_GROUP,
                  dead_letters=store.keys.dead_letters)


def _decode(entry_id: str, fields: dict[bytes, bytes]) -> VersionRebuild:
    return VersionRebuild.from_wire(fields.get(b"m"))


async def _add(store: RedisStore, record: VersionRebuild) -> str:
    entry_id = await store.redis.xadd(store.keys.version_rebuilds, {"m": record.to_wire()}, maxlen=MAX_ENTRIES,
                                      approximate=True)
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


async def ask_rebuild(store: RedisStore, version: str, by: str, reason: str = "") -> str:
    """Ask whoever can to rebuild ``version`` (its weights are gone); the id to wait for answers after."""
    return await _add(store, VersionRebuild(RebuildAction.ASK, version, by, reason, time.time()))


async def announce_rebuilt(store: RedisStore, version: str, by: str) -> None:
    """``version``'s weights are stored again (whoever rebuilt them, asked or not)."""
    await _add(store, VersionRebuild(RebuildAction.REBUILT, version, by, "", time.time()))


async def wait_for_answer(store: RedisStore, version: str, after: str,
                          timeout_s: float) -> tuple[str, VersionRebuild] | None:
    """The first answer about ``version`` written after entry ``after`` and its entry id, waiting up
    to ``timeout_s`` (blocking on the stream); None if none came."""
    cursor = await _stream(store).cursor(after)
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        for entry_id, record in await cursor.read(left):
            if record.model_version == version and record.action != RebuildAction.ASK:
                return entry_id, record
    return None


async def answer_asks(store: RedisStore, by: str, rebuild: Callable[[str], Awaitable[object]]) -> int:
    """Answer the asks not answered yet (``rebuild(version)`` raising is a refusal, with the reason);
    the number answered. A crash before the acknowledgement answers them again."""
    stream = _stream(store)
    answered = 0
    for pending in (True, False):  # what this consumer took before a restart, then what is new
        entries = await stream.read(by, ASKS_PER_READ, pending=pending)
        done: dict[str, VersionRebuild | None] = {}
        for _, ask in entries:
            if ask.action != RebuildAction.ASK or ask.model_version in done:
                continue
            try:
                rebuilt = await rebuild(ask.model_version)
                # a rebuild that wrote the weights announced them; one that found them whole did not
                done[ask.model_version] = (None if getattr(rebuilt, "checkpoint", None) is not None else
                                           VersionRebuild(RebuildAction.REBUILT, ask.model_version, by, "", time.time()))
            except Exception as e:  # an ask must never stop the trainer: the asker hears why instead
                reason = str(e) if isinstance(e, InvalidInput) else f"the rebuild failed: {type(e).__name__}: {e}"
                log.error("asked by %s to rebuild model version %s: %s", ask.by, ask.model_version, reason)
                done[ask.model_version] = VersionRebuild(RebuildAction.REFUSED, ask.model_version, by, reason[:2000],
                                                         time.time())
        for answer in done.values():
            if answer is not None:
                await _add(store, answer)
        await stream.ack([entry_id for entry_id, _ in entries])
        answered += len(done)
    return answered
