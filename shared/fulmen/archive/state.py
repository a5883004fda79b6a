"""The run's state in the archive: the small keys that say where an experiment stands, as one snapshot.

The algorithm's position, the adapter's counters, the trainer's untrained groups, the sampled
marker, the resources counter and shard count, the workers as they last reported, the stored model
versions' index (manifests and delta bases, not the chunks), and every consumer group's cursor and
consumers. A pass writes a snapshot only when it differs from the newest archived; restore puts
the newest back. What each is for, and what is left out: docs/design/store.md.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import msgpack
from redis.exceptions import ResponseError

from fulmen import keys as k
from fulmen.archive.files import chunk_name, list_chunks, read_file, write_file
from fulmen.store.redis.stream import entry_id_text
from fulmen.store.redis_store import RedisStore

KIND = "state"
# `fulmen.keys.Keys` attributes, by the type of key they name
HASHES = ("algorithm_state", "adapter_stats", "workers", "version_bases", "version_manifests")
SETS = ("algorithm_done", "trainer_untrained", "trainer_filtered", "sampled")
ZSETS = ("stored_versions",)
STRINGS = ("resources_version", "shards_count", "run_config")
SET_PAGE = 1000


def group_streams(keys: k.Keys) -> list[tuple[str, int, str]]:
    """(name, shard, key) of every stream a consumer group reads: each lane's queue and the finished
    stream in each shard, and the samples stream."""
    streams = [(f"queue:{lane}", shard.index, shard.lane_queue(lane)) for shard in keys.shards for lane in k.LANES]
    streams += [("finished", shard.index, shard.finished) for shard in keys.shards]
    return [*streams, ("samples", 0, keys.samples)]


def stream_key(keys: k.Keys, name: str, shard: int) -> str:
    """The key of a `group_streams` entry in ``keys``' experiment."""
    if name.startswith("queue:"):
        return keys.shards[shard].lane_queue(name.partition(":")[2])
    return keys.shards[shard].finished if name == "finished" else keys.samples


async def capture(store: RedisStore) -> dict[str, Any]:
    """The state snapshot of ``store``'s experiment (the archive's own group left out)."""
    redis, keys = store.redis, store.keys
    state: dict[str, Any] = {"hashes": {}, "sets": {}, "zsets": {}, "strings": {}, "groups": []}
    for name in HASHES:
        state["hashes"][name] = dict(sorted((await redis.hgetall(getattr(keys, name))).items()))
    for name in SETS:
        state["sets"][name] = sorted([m async for m in redis.sscan_iter(getattr(keys, name), count=SET_PAGE)])
    for name in ZSETS:
        state["zsets"][name] = [[m, s] for m, s in await redis.zrange(getattr(keys, name), 0, -1, withscores=True)]
    for name in STRINGS:
        state["strings"][name] = await redis.get(getattr(keys, name))
    for name, shard, key in group_streams(keys):
        try:
            groups = await redis.xinfo_groups(key)
        except ResponseError:  # no such stream
            continue
        for info in groups:
            group = entry_id_text(info["name"])
            if group == k.ARCHIVE_GROUP:
                continue
            consumers = await redis.xinfo_consumers(key, group)
            state["groups"].append({
                "stream": name, "shard": shard, "group": group, "last_id": entry_id_text(info["last-delivered-id"]),
                "consumers": sorted(entry_id_text(c["name"]) for c in consumers),
            })
    return state


def newest(directory: Path) -> dict[str, Any] | None:
    """The newest state snapshot archived in ``directory`` (None: none yet)."""
    chunks = list_chunks(directory, KIND)
    if not chunks:
        return None
    _header, records = read_file(chunks[-1].path, KIND)
    found = next(records, None)
    records.close()  # type: ignore[attr-defined]  # a generator
    return found if isinstance(found, dict) else None


async def archive_state(store: RedisStore, directory: Path) -> Path | None:
    """Write the snapshot unless it is the newest one archived; the file written, or None."""
    state = await capture(store)
    if _packed(state) == _packed(newest(directory)):
        return None
    now = await store.redis.time()
    at = f"{int(now[0]) * 1000 + int(now[1]) // 1000}-0"
    path = directory / chunk_name(KIND, 0, at, at)
    write_file(path, {"kind": KIND, "experiment": store.experiment, "shard": 0, "first": at, "last": at,
                      "count": 1, "written": time.time()}, [state])
    return path


def _packed(state: dict[str, Any] | None) -> bytes:
    return msgpack.packb(state, use_bin_type=True)


async def apply(store: RedisStore, state: dict[str, Any]) -> int:
    """Write ``state`` into ``store``'s experiment (which has none of these keys); returns the groups made."""
    redis, keys = store.redis, store.keys
    pipe = redis.pipeline(transaction=False)
    for name, fields in (state.get("hashes") or {}).items():
        if name in HASHES and fields:
            pipe.hset(getattr(keys, name), mapping=fields)
    for name, members in (state.get("sets") or {}).items():
        for start in range(0, len(members) if name in SETS else 0, SET_PAGE):
            pipe.sadd(getattr(keys, name), *members[start:start + SET_PAGE])
    for name, members in (state.get("zsets") or {}).items():
        if name in ZSETS and members:
            pipe.zadd(getattr(keys, name), {m: score for m, score in members})
    for name, value in (state.get("strings") or {}).items():
        if name in STRINGS and value is not None:
            pipe.set(getattr(keys, name), value)
    await pipe.execute()
    made = 0
    for group in state.get("groups") or []:
        key = stream_key(keys, group["stream"], group["shard"])
        with contextlib.suppress(ResponseError):  # BUSYGROUP: made already
            await redis.xgroup_create(key, group["group"], id=group["last_id"], mkstream=True)
            made += 1
        for consumer in group["consumers"]:
            await redis.xgroup_createconsumer(key, group["group"], consumer)
    return made
