"""When Redis rewrites its append-only file: between model versions, not while one is written.

Redis rewrites the AOF by itself once the file has grown by ``auto-aof-rewrite-percentage`` since
the last rewrite. Nothing grows it as fast as a model version's weights (1 GB for a 0.5B model in
bf16), so that threshold is crossed while a version is being written, nearly always: the server then
forks and writes the whole dataset again (gigabytes) on the cores the publish and the proxies' reads
need, and the version is served seconds later (issue 16: the publish → serving time of a full 0.5B
version varied from 4.4 to 7.5 s with it).

So the servers Fulmen starts (`fulmen.embedded`, deploy/redis.conf) leave their own rule a margin
(``auto-aof-rewrite-percentage 300``: it stays the safety net that bounds the file when nothing calls
this), and `rewrite_if_grown` applies the usual rule (grown by 100% since the last rewrite, at least
512 MB) at the moment retention has just deleted old versions (`fulmen.version_retention`), when the
dataset is smallest and no version is on its way to the proxies.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

log = logging.getLogger(__name__)

MIN_BYTES = 512 << 20  # as Redis's auto-aof-rewrite-min-size in fulmen.embedded
GROWTH = 1.0  # grown by 100% since the last rewrite, as Redis's default auto-aof-rewrite-percentage
SAFETY_NET_PERCENTAGE = 300  # the server's own rule (fulmen.embedded): only when this was not called


async def rewrite_if_grown(redis: Any, min_bytes: int | None = None, growth: float = GROWTH) -> bool:
    """Start a background AOF rewrite if the file is at least ``min_bytes`` and has grown by
    ``growth`` (1.0: doubled) since the last rewrite; whether one was started. Nothing on a server
    without AOF, with a rewrite already under way, or one that refuses the commands (a managed Redis).
    Nothing on a cluster either: its nodes keep their own rule (one INFO would describe one node)."""
    if isinstance(redis, RedisCluster):
        return False
    try:
        info = await redis.info("persistence")
    except ResponseError as e:
        log.debug("no AOF rewrite: the server does not tell its persistence (%s)", e)
        return False
    if not info.get("aof_enabled") or info.get("aof_rewrite_in_progress") or info.get("aof_rewrite_scheduled"):
        return False
    size, base = int(info.get("aof_current_size", 0)), int(info.get("aof_base_size", 0))
    if size < (MIN_BYTES if min_bytes is None else min_bytes) or size < base * (1 + growth):
        return False
    try:
        await redis.bgrewriteaof()
    except ResponseError as e:  # e.g. renamed away by the provider, or a rewrite that just started
        log.info("the AOF rewrite was not started (%s); Redis's own rule will rewrite it", e)
        return False
    log.info("AOF rewrite started: %.0f MB, %.0f MB after the last rewrite", size / 1e6, base / 1e6)
    return True
