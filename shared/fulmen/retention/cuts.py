"""Where a stream may be cut: the id below which retention removes entries, and removing them.

The lower of the policy's cut and `consumed_cut` wins, so nothing a group still needs is removed; on
the logs no group reads, `archived_cut` keeps what `fulmen archive` has not written. More:
docs/design/store.md.
"""

from __future__ import annotations

from typing import Any

from fulmen.store.redis.stream_ids import StreamId, consumed_below, format_id, parse_id

COUNT_PAGE = 1000  # entries read per round trip when a dry run counts what a cut would remove


async def server_now_ms(redis: Any) -> int:
    """The server's clock (stream ids carry it), in milliseconds."""
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def age_cut(now_ms: int, max_age_s: float) -> StreamId:
    """The cut that removes every entry at least ``max_age_s`` old at ``now_ms``: with 0, every entry
    up to now, those written in this very millisecond included."""
    return (max(0, now_ms - int(max_age_s * 1000)) + 1, 0)


async def policy_cut(
    redis: Any, stream: str, max_age_s: float | None, max_count: int | None, now_ms: int
) -> StreamId | None:
    """The smallest id the limits keep (entries below it are old or surplus), or None: keep all."""
    cut: StreamId | None = None
    if max_age_s is not None:
        cut = age_cut(now_ms, max_age_s)
    if max_count is not None:
        newest = await redis.xrevrange(stream, count=max_count + 1)
        if len(newest) > max_count:
            # keep the newest max_count: everything up to and including the (max_count+1)-th goes
            surplus_last = parse_id(newest[-1][0])
            by_count = (surplus_last[0], surplus_last[1] + 1)
            cut = by_count if cut is None else max(cut, by_count)
    return cut


async def consumed_cut(redis: Any, stream: str) -> StreamId | None:
    """The smallest id some consumer group of ``stream`` still needs (not yet delivered to it, or
    delivered and not acknowledged); None when the stream has no group (or does not exist): then
    nothing of it counts as consumed."""
    if not await redis.exists(stream):
        return None
    groups = await redis.xinfo_groups(stream)
    first_pending: dict[str, StreamId | None] = {}
    for g in groups:
        name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
        summary = await redis.xpending(stream, name)
        lowest = summary.get("min") if summary and summary.get("pending") else None
        first_pending[name] = parse_id(lowest) if lowest else None
    return consumed_below(groups, first_pending)


async def archived_cut(redis: Any, archived: str, stream: str) -> StreamId | None:
    """The smallest id `fulmen archive` has not written yet, for a log no group reads (the trainer's
    steps, the resources log, the dead letters): entries below it are in the archive. None: the
    archive never ran on this experiment, so it keeps nothing back."""
    last = await redis.hget(archived, stream)
    if last is None:
        return None
    ms, seq = parse_id(last)
    return (ms, seq + 1)


def lower(cut: StreamId | None, floor: StreamId | None) -> StreamId | None:
    """``cut``, but never above ``floor`` (None: no floor)."""
    return cut if cut is None or floor is None else min(cut, floor)


async def safe_cut(
    redis: Any, stream: str, max_age_s: float | None, max_count: int | None, now_ms: int
) -> StreamId | None:
    """The cut of a consumed stream: what the limits want gone, but only what every group acknowledged."""
    wanted = await policy_cut(redis, stream, max_age_s, max_count, now_ms)
    if wanted is None:
        return None
    consumed = await consumed_cut(redis, stream)
    return None if consumed is None else min(wanted, consumed)


async def count_below(redis: Any, stream: str, cut: StreamId) -> int:
    """How many entries lie below ``cut`` (what a trim to it would remove; for a dry run)."""
    total, start = 0, "-"
    while True:
        page = await redis.xrange(stream, min=start, max=f"({format_id(cut)}", count=COUNT_PAGE)
        total += len(page)
        if len(page) < COUNT_PAGE:
            return total
        last = page[-1][0]
        start = "(" + (last.decode() if isinstance(last, bytes) else last)


async def trim_below(redis: Any, stream: str, cut: StreamId | None, dry_run: bool) -> int:
    """Remove the entries below ``cut`` (exactly: MINID without ``~``); with ``dry_run``, only count
    them. Returns how many go."""
    if cut is None or cut <= (0, 0):
        return 0
    if dry_run:
        return await count_below(redis, stream, cut)
    return int(await redis.xtrim(stream, minid=format_id(cut), approximate=False))
