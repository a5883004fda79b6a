"""Meeting over the store for a weight group (`fulmen.versions.transport.group`): where the trainer's
rendezvous listens (`advertise`, `advertised`), and vllm-sync's asks to it (`ask`, `AskStream`).

An ask older than the timeout its asker waits is stale: the asker has given up (and loads from a
folder), so the trainer skips it. The design: docs/design/vllm-sync.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fulmen import keys as k
from fulmen.records import WeightGroupAsk
from fulmen.store.redis.stream import Stream

if TYPE_CHECKING:
    from fulmen.store import RedisStore

MAX_ENTRIES = 1000  # asks matter for seconds, not for the run


@dataclass(frozen=True)
class Rendezvous:
    """Where the trainer's rank 0 meets the vLLM workers of each group."""

    host: str
    port: int
    backend: str


async def advertise(store: RedisStore, rendezvous: Rendezvous) -> None:
    await store.redis.hset(store.keys.weight_group, mapping={"host": rendezvous.host, "port": rendezvous.port,
                                                             "backend": rendezvous.backend, "time": time.time()})


async def withdraw(store: RedisStore) -> None:
    await store.redis.delete(store.keys.weight_group)


async def advertised(store: RedisStore) -> Rendezvous | None:
    """The trainer's rendezvous, or None when no trainer serves one."""
    fields = {(key.decode() if isinstance(key, bytes) else key): (v.decode() if isinstance(v, bytes) else v)
              for key, v in (await store.redis.hgetall(store.keys.weight_group)).items()}
    try:
        return Rendezvous(fields["host"], int(fields["port"]), fields["backend"])
    except (KeyError, ValueError):
        return None


async def ask(store: RedisStore, record: WeightGroupAsk) -> str:
    entry_id = await store.redis.xadd(store.keys.weight_group_asks, {"m": record.to_wire()}, maxlen=MAX_ENTRIES,
                                      approximate=True)
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def ask_stream(store: RedisStore) -> Stream[WeightGroupAsk]:
    """The asks as the trainer reads them (its consumer group starts at the newest: asks made before
    it ran have been given up on)."""
    return Stream(store.redis, store.keys.weight_group_asks, _decode, group=k.WEIGHT_SENDERS_GROUP,
                  dead_letters=store.keys.dead_letters, group_start="$")


def stale(record: WeightGroupAsk, timeout_s: float, now: float | None = None) -> bool:
    return (now if now is not None else time.time()) - record.time > timeout_s


def _decode(entry_id: str, fields: dict[bytes, bytes]) -> WeightGroupAsk:
    return WeightGroupAsk.from_wire(fields.get(b"m"))
