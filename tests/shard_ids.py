"""Rollout ids chosen to land on given store shards (tests that must cover every shard)."""

from __future__ import annotations

from fulmen.keys import shard_of


def ids_per_shard(shards: int, n: int, prefix: str = "r") -> dict[int, list[str]]:
    """``n`` rollout ids of each of the ``shards`` shards, in the order they were found."""
    by_shard: dict[int, list[str]] = {i: [] for i in range(shards)}
    i = 0
    while any(len(ids) < n for ids in by_shard.values()):
        rid = f"{prefix}{i:04d}"
        ids = by_shard[shard_of(rid, shards)]
        if len(ids) < n:
            ids.append(rid)
        i += 1
    return by_shard
