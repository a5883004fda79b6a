"""Meeting over the store for a weight group (`fulmen.versions.transport.group`): where the trainer's
rendezvous listens (`advertise`, `advertised`), the full version it holds to send (`announce_held`,
`held`: before its folder is written), and vllm-sync's asks to it (`ask`, `ask_stream`).

An ask is aged by Redis's clock (its entry id): one older than half its asker's wait is skipped. The
advertisement expires unless the trainer refreshes it (a trainer gone is not joined). The design:
docs/design/vllm-sync.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fulmen import keys as k
from fulmen.records import WeightGroupAsk
from fulmen.store.redis.stream import Stream

if TYPE_CHECKING:
    from fulmen.store import RedisStore

MAX_ENTRIES = 1000  # asks matter for seconds, not for the run
ADVERTISEMENT_TTL_S = 30  # the trainer refreshes it every third of this


@dataclass(frozen=True)
class Rendezvous:
    """Where the trainer's rank 0 meets the vLLM workers of each group (``started``: when it began
    listening; a restarted trainer's differs even on the same port)."""

    host: str
    port: int
    backend: str
    started: float = field(default_factory=time.time)


async def advertise(store: RedisStore, rendezvous: Rendezvous, ttl_s: float = ADVERTISEMENT_TTL_S) -> None:
    async with store.redis.pipeline(transaction=True) as pipe:
        pipe.hset(store.keys.weight_group, mapping={"host": rendezvous.host, "port": rendezvous.port,
                                                    "backend": rendezvous.backend, "started": rendezvous.started})
        pipe.expire(store.keys.weight_group, max(1, round(ttl_s)))
        await pipe.execute()


async def withdraw(store: RedisStore) -> None:
    await store.redis.delete(store.keys.weight_group)


async def announce_held(store: RedisStore, version: str) -> None:
    """Say that the advertised trainer holds ``version`` to send (a field of its advertisement: gone
    with it)."""
    await store.redis.hset(store.keys.weight_group, "held", version)


async def held(store: RedisStore) -> str | None:
    """The version the advertised trainer holds to send, or None (no trainer, or none held yet)."""
    host, version = await store.redis.hmget(store.keys.weight_group, ["host", "held"])
    if host is None or version is None:
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


async def advertised(store: RedisStore) -> Rendezvous | None:
    """The trainer's rendezvous, or None when no trainer serves one."""
    fields = {(key.decode() if isinstance(key, bytes) else key): (v.decode() if isinstance(v, bytes) else v)
              for key, v in (await store.redis.hgetall(store.keys.weight_group)).items()}
    try:
        return Rendezvous(fields["host"], int(fields["port"]), fields["backend"], float(fields["started"]))
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


async def redis_time(store: RedisStore) -> float:
    seconds, micros = await store.redis.time()
    return float(seconds) + float(micros) / 1e6


def entry_time(entry_id: str) -> float:
    """When Redis added a stream entry (its id's milliseconds), in seconds."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


def _decode(entry_id: str, fields: dict[bytes, bytes]) -> WeightGroupAsk:
    return WeightGroupAsk.from_wire(fields.get(b"m"))
