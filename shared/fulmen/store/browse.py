"""Browsing an experiment's rollouts a page at a time, filtered, with bounded work per page.

Walks the rollout index from a cursor, at most ``scan_budget`` entries a page; never scans the
keyspace or writes. The cursor and why: docs/design/store.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fulmen import keys as k
from fulmen.codec import unpack
from fulmen.errors import InvalidInput, RecordError
from fulmen.records.status import RolloutMode, RolloutStatus

CHUNK = 500  # index entries per round trip
SCAN_BUDGET = 2_000  # index entries one page may look at (its cost: bench/RESULTS.md)
# A status filter whose sets hold at most this many rollouts reads them from the status sets instead
# of walking the index: exact for the rare statuses one looks for (failed, running), however old.
STATUS_SET_MAX = 5_000
MAX_PAGE = 200  # rollouts on one page
# What a row needs, in HMGET order; ``model_version`` is the version that served the rollout's last
# LLM call, written by the adapter when it samples the rollout (absent before, or without calls).
FIELDS = ("rollout_id", "status", "mode", "reward", "enqueue_time", "end_time", "attempt_n", "model_version")
INPUT_CHARS = 200  # of a row's input, shown as JSON


@dataclass(frozen=True, slots=True)
class RolloutFilter:
    """Which rollouts a page shows. Every field None (or empty): all of them."""

    statuses: frozenset[RolloutStatus] = frozenset()
    mode: RolloutMode | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    model_version: str | None = None
    since: float | None = None  # enqueue time, seconds since the epoch, inclusive
    until: float | None = None

    def __post_init__(self) -> None:
        try:  # plain strings are welcome: kept as the enums the rows carry
            object.__setattr__(self, "statuses", frozenset(RolloutStatus(x) for x in self.statuses))
            object.__setattr__(self, "mode", None if self.mode is None else RolloutMode(self.mode))
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        for name in ("min_reward", "max_reward", "since", "until"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InvalidInput(f"{name} must be a finite number, got {value!r}")
        if self.model_version is not None:
            k.check_id("model_version", self.model_version)

    def matches(self, row: RolloutRow) -> bool:
        if self.statuses and row.status not in self.statuses:
            return False
        if self.mode is not None and row.mode is not self.mode:
            return False
        if self.min_reward is not None and (row.reward is None or row.reward < self.min_reward):
            return False
        if self.max_reward is not None and (row.reward is None or row.reward > self.max_reward):
            return False
        return self.model_version is None or row.model_version == self.model_version


@dataclass(frozen=True, slots=True)
class RolloutRow:
    rollout_id: str
    status: RolloutStatus
    mode: RolloutMode | None
    reward: float | None
    enqueue_time: float | None
    end_time: float | None
    attempts: int
    model_version: str | None
    input_preview: str = ""


@dataclass(frozen=True, slots=True)
class Cursor:
    score: float  # the enqueue time the next read starts at (inclusive), math.inf for the newest
    skip: int = 0  # entries with exactly that score already seen

    def encode(self) -> str:
        return f"{self.score!r}:{self.skip}"

    @classmethod
    def decode(cls, text: str) -> Cursor:
        score, sep, skip = text.partition(":")
        try:
            value, seen = float(score), int(skip)
        except ValueError:
            raise InvalidInput(f"cursor {text!r} is malformed") from None
        if not sep or math.isnan(value) or seen < 0 or seen > 10**9:
            raise InvalidInput(f"cursor {text!r} is malformed")
        return cls(value, seen)


@dataclass(frozen=True, slots=True)
class RolloutPage:
    rows: list[RolloutRow]
    scanned: int  # index entries looked at
    next_cursor: Cursor | None  # None: nothing older is left
    total: int  # rollouts in the index
    extra: dict[str, Any] = field(default_factory=dict)


def _text(value: bytes | None) -> str:
    return value.decode(errors="replace") if value else ""


def _float(value: bytes | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _row(values: Sequence[bytes | None]) -> RolloutRow | None:
    rollout_id, status, mode, reward, enqueued, ended, attempts, version = values
    try:
        return RolloutRow(
            _text(rollout_id), RolloutStatus(_text(status)), RolloutMode(_text(mode)) if mode else None,
            _float(reward), _float(enqueued), _float(ended), int(attempts or 0), _text(version) or None,
        )
    except ValueError:
        return None  # gone between the two reads, or unreadable: not shown


def _preview(blob: bytes | None) -> str:
    import json

    if not blob:
        return ""
    try:
        text = json.dumps(unpack(blob), default=str, ensure_ascii=False)
    except (RecordError, ValueError, TypeError):
        return "(unreadable)"
    return text if len(text) <= INPUT_CHARS else text[: INPUT_CHARS - 1] + "…"


def _bound(value: float) -> str | float:
    return "+inf" if value == math.inf else "-inf" if value == -math.inf else repr(value)


async def browse_rollouts(
    client: Any, keys: k.Keys, where: RolloutFilter, *, limit: int = 50, cursor: Cursor | None = None,
    scan_budget: int = SCAN_BUDGET,
) -> RolloutPage:
    """One page of rollouts matching ``where``, newest first, from ``cursor`` (None: the newest)."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"limit must be between 1 and {MAX_PAGE}, got {limit}")
    if where.statuses:
        page = await _from_status_sets(client, keys, where, limit, cursor)
        if page is not None:
            return page
    top = math.inf if where.until is None else where.until
    position = cursor or Cursor(top)
    if position.score > top:
        position = Cursor(top)
    low = -math.inf if where.since is None else where.since
    rows: list[RolloutRow] = []
    scanned = 0
    exhausted = False
    while len(rows) < limit and scanned < scan_budget:
        asked = min(CHUNK, scan_budget - scanned)
        entries = await _index_chunk(client, keys, position, low, asked)
        if not entries:
            exhausted = True
            break
        position, looked = await _match_chunk(client, keys, [(score, rid) for rid, score in entries], position,
                                              where, rows, limit)
        scanned += looked
        if len(entries) < asked and len(rows) < limit:
            exhausted = True  # a short chunk is the end of the range
            break
    return RolloutPage(await _previews(client, keys, rows), scanned, None if exhausted else position,
                       await _total(client, keys))


async def _total(client: Any, keys: k.Keys) -> int:
    return sum([int(await client.zcard(shard.rollout_index)) for shard in keys.shards])


async def _match_chunk(
    client: Any, keys: k.Keys, chunk: Sequence[tuple[float, bytes]], position: Cursor, where: RolloutFilter,
    rows: list[RolloutRow], limit: int,
) -> tuple[Cursor, int]:
    """Read the rows of ``chunk`` ((score, rollout id) in index order, one round trip) and append those
    ``where`` matches to ``rows``, stopping at ``limit``. Returns the cursor after the last one looked
    at and how many were looked at."""
    pipe = client.pipeline(transaction=False)
    for _, rid in chunk:
        pipe.hmget(keys.rollout(rid.decode()), FIELDS)
    looked = 0
    for (score, _), values in zip(chunk, await pipe.execute(), strict=True):
        looked += 1
        position = Cursor(score, position.skip + 1) if score == position.score else Cursor(score, 1)
        row = _row(values)
        if row is not None and where.matches(row):
            rows.append(row)
            if len(rows) == limit:
                break
    return position, looked


async def _index_chunk(client: Any, keys: k.Keys, position: Cursor, low: float, asked: int) -> list[Any]:
    """The next ``asked`` index entries below the cursor, newest first. With several shards, each
    shard's index is read from the cursor's score and the lists merged in the index's own order
    (score, then id, descending), so the cursor's skip counts the same entries as with one index."""
    high = _bound(position.score)
    if len(keys.shards) == 1:
        return list(await client.zrevrangebyscore(
            keys.rollout_index, high, _bound(low), start=position.skip, num=asked, withscores=True,
        ))
    merged: list[Any] = []
    for shard in keys.shards:
        merged += await client.zrevrangebyscore(
            shard.rollout_index, high, _bound(low), start=0, num=position.skip + asked, withscores=True,
        )
    merged.sort(key=lambda entry: (entry[1], entry[0]), reverse=True)
    return merged[position.skip:position.skip + asked]


async def _previews(client: Any, keys: k.Keys, rows: list[RolloutRow]) -> list[RolloutRow]:
    if not rows:
        return rows
    pipe = client.pipeline(transaction=False)
    for row in rows:
        pipe.hget(keys.rollout(row.rollout_id), "input")
    return [_with_preview(row, blob) for row, blob in zip(rows, await pipe.execute(), strict=True)]


async def _from_status_sets(
    client: Any, keys: k.Keys, where: RolloutFilter, limit: int, cursor: Cursor | None
) -> RolloutPage | None:
    """The page read from the status sets (ordered by enqueue time here), or None when they are too
    large for that and the index walk is cheaper."""
    statuses = sorted(s.value for s in where.statuses)
    pipe = client.pipeline(transaction=False)
    for shard in keys.shards:
        for status in statuses:
            pipe.scard(shard.status(status))
    if sum(await pipe.execute()) > STATUS_SET_MAX:
        return None
    ids: list[Any] = []
    scores: list[Any] = []
    for shard in keys.shards:  # a shard's ids are scored by its own index
        shard_ids = list(await client.sunion([shard.status(s) for s in statuses]))
        ids += shard_ids
        scores += await client.zmscore(shard.rollout_index, shard_ids) if shard_ids else []
    top = math.inf if where.until is None else where.until
    low = -math.inf if where.since is None else where.since
    # newest first, ties in the index's own order for equal scores (reverse lexicographic)
    ordered = sorted(((score, rid) for rid, score in zip(ids, scores, strict=True) if score is not None
                      and low <= score <= top), reverse=True)
    position = cursor or Cursor(top)
    start = 0
    while start < len(ordered) and ordered[start][0] > position.score:
        start += 1
    start += position.skip if position.score != math.inf else 0
    candidates = ordered[start:]
    rows: list[RolloutRow] = []
    scanned = 0
    for first in range(0, len(candidates), CHUNK):
        position, looked = await _match_chunk(client, keys, candidates[first:first + CHUNK], position, where, rows,
                                              limit)
        scanned += looked
        if len(rows) == limit:
            break
    more = len(rows) == limit and scanned < len(candidates)
    return RolloutPage(await _previews(client, keys, rows), scanned, position if more else None,
                       await _total(client, keys))


def _with_preview(row: RolloutRow, blob: bytes | None) -> RolloutRow:
    return RolloutRow(
        row.rollout_id, row.status, row.mode, row.reward, row.enqueue_time, row.end_time, row.attempts,
        row.model_version, _preview(blob),
    )
