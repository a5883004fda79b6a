"""Control messages that decode but hold unusable values are skipped with a log line; the proxy keeps
following the stream and obeys the next valid message (issue 20, item 7)."""

from __future__ import annotations

import asyncio
import math
import time

from fulmen import codec
from fulmen.store import RedisStore
from fulmen_llm_proxy.control import ControlFollower, send_control
from fulmen_llm_proxy.gate import Gate


def _control(control_id: str, **fields: object) -> bytes:
    record = {"action": "pause", "control_id": control_id, "proxy_ids": [], "timeout_s": 60.0, "time": time.time()}
    return codec.pack_record("control", {**record, **fields})


POISON = [
    _control("nan-timeout", timeout_s=math.nan),
    _control("negative-timeout", timeout_s=-5.0),
    _control("huge-timeout", timeout_s=1e300),
    _control("infinite-time", time=math.inf),
    _control("numeric-proxy-ids", proxy_ids=[1, 2]),
    _control("string-timeout", timeout_s="10"),
    _control("unknown-action", action="explode"),
]


async def _until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_poison_control_messages_are_skipped_and_later_ones_obeyed(real_store: RedisStore) -> None:
    """No poison message changes the gate; the valid messages around them do."""
    store = real_store
    changes: list[tuple[str, str]] = []
    gate = Gate()
    follower = ControlFollower(store, gate, "p1", lambda: changes.append((gate.state, follower.control_id)))
    task = asyncio.ensure_future(follower.run())
    try:
        # the follower is on the stream once it obeys a message sent after it started
        while not changes:
            first = await send_control(store, "resume")
            await asyncio.sleep(0.05)
        assert follower.control_id == first.control_id
        changes.clear()
        for data in POISON:
            await store.redis.xadd(store.keys.control, {"m": data})
        pause = await send_control(store, "pause", timeout_s=None)
        await _until(lambda: follower.control_id == pause.control_id, "the valid pause after the poison")
        resume = await send_control(store, "resume")
        await _until(lambda: follower.control_id == resume.control_id, "the resume")
        assert changes == [("paused", pause.control_id), ("serving", resume.control_id)]
        assert not task.done()
    finally:
        task.cancel()
        follower.close()
