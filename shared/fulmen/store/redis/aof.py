"""When Redis rewrites its append-only file: between model versions, not while one is written.

Entry points `rewrite_if_grown` (called by retention) and `writing_weights` (around every publish to
a stream). Why: docs/design/model-versions.md; figures: bench/RESULTS.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

log = logging.getLogger(__name__)

MIN_BYTES = 512 << 20  # as Redis's auto-aof-rewrite-min-size in fulmen.store.redis.embedded
GROWTH = 1.0  # grown by 100% since the last rewrite, as Redis's default auto-aof-rewrite-percentage
SAFETY_NET_PERCENTAGE = 300  # the server's own rule (fulmen.store.redis.embedded): only when this was not called
# Per server, not per experiment (one AOF holds every experiment's keys): the weights being written
# now, each member scored by the server time (s) its claim lapses at
WRITES_KEY = "fulmen:aof:weights-writes"
WRITE_LEASE_S = 600.0  # a 1 GB version takes seconds to write; a claim older than this is a dead publisher's
REWRITE_WAIT_S = 120.0  # a publish waits this long at most for a running rewrite, then writes anyway
POLL_S = 0.05


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
        busy = await weights_being_written(redis)
    except ResponseError as e:  # the claims cannot be read: the rule alone decides, as before them
        log.debug("AOF rewrite: the weights writes in flight are unknown (%s)", e)
        busy = False
    if busy:
        log.info("AOF rewrite deferred: a model version's weights are being written (%.0f MB)", size / 1e6)
        return False
    try:
        await redis.bgrewriteaof()
    except ResponseError as e:  # e.g. renamed away by the provider, or a rewrite that just started
        log.info("the AOF rewrite was not started (%s); Redis's own rule will rewrite it", e)
        return False
    log.info("AOF rewrite started: %.0f MB, %.0f MB after the last rewrite", size / 1e6, base / 1e6)
    return True


async def _server_time(redis: Any) -> float:
    seconds, micros = await redis.time()
    return seconds + micros / 1e6


async def weights_being_written(redis: Any) -> bool:
    """Whether a publish is writing a version's weights to this server now (a live claim in
    ``WRITES_KEY``; lapsed ones, from publishers that died mid-write, are dropped)."""
    await redis.zremrangebyscore(WRITES_KEY, "-inf", await _server_time(redis))
    return bool(await redis.zcard(WRITES_KEY))


async def wait_for_rewrite(redis: Any, wait_s: float = REWRITE_WAIT_S, poll_s: float = POLL_S) -> bool:
    """Wait until no AOF rewrite runs or is scheduled on ``redis``, up to ``wait_s``; whether none
    does (also true on a server that does not tell)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = await redis.info("persistence")
        except ResponseError:
            return True
        if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
            return True
        if time.monotonic() >= deadline:
            log.warning("an AOF rewrite still runs after %.0f s: writing the model version during it", wait_s)
            return False
        await asyncio.sleep(poll_s)


@contextlib.asynccontextmanager
async def writing_weights(redis: Any, wait_s: float = REWRITE_WAIT_S) -> AsyncIterator[Callable[[], Awaitable[bool]]]:
    """Around a publish that writes a version's weights to ``redis``: no rewrite starts meanwhile
    (`rewrite_if_grown` defers it). Yields ``ready``: await it right before the first chunk, to let
    a rewrite that was already running end first (`wait_for_rewrite`); the publish's own work before
    it (hashing, serialising) overlaps the wait. Nothing on a cluster (its nodes rewrite by their
    own rule) or a server that refuses the commands."""

    async def ready() -> bool:
        return await wait_for_rewrite(redis, wait_s)

    async def nothing() -> bool:
        return True

    if isinstance(redis, RedisCluster):
        yield nothing
        return
    member = uuid.uuid4().hex
    try:
        await redis.zadd(WRITES_KEY, {member: await _server_time(redis) + WRITE_LEASE_S})
    except ResponseError as e:  # e.g. an ACL without these commands: publish as before
        log.debug("model version writes not claimed against AOF rewrites (%s)", e)
        yield nothing
        return
    try:
        yield ready
    finally:
        with contextlib.suppress(Exception):  # else it lapses after WRITE_LEASE_S
            await redis.zrem(WRITES_KEY, member)
