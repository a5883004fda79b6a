"""Retention of the model's side of the store: the weights streams and the resources log.

The log is never cut past the oldest entry a stored or served version still needs.
Which one: docs/design/store.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fulmen.errors import RecordError
from fulmen.records import ResourcesUpdate
from fulmen.retention.cuts import archived_cut, lower, policy_cut
from fulmen.store.redis.stream_ids import StreamId, format_id, parse_id
from fulmen.store.redis_store import RedisStore

log = logging.getLogger(__name__)

PAGE = 200  # resources log entries read per round trip


async def trim_weights(store: RedisStore, keep: int, weights_dir: Path | None, dry_run: bool) -> list[str]:
    """The model versions whose weights go (oldest first), deleted unless ``dry_run``."""
    from fulmen.versions.retention import retain_versions, versions_to_delete

    if dry_run:
        return await versions_to_delete(store, keep)
    return await retain_versions(store, keep, weights_dir)


async def trim_resources_log(
    store: RedisStore,
    max_age_s: float | None,
    max_count: int | None,
    now_ms: int,
    dry_run: bool,
    doomed_versions: Sequence[str] = (),
) -> int:
    """Trim the resources log by the limits, never into its needed part (the module docstring);
    with each entry goes its version of the resources hash, unless it is its id's latest. Returns the
    entries removed (with ``dry_run``: that would be). ``doomed_versions``: model versions whose
    weights are going in this same pass (a dry run has not deleted them yet)."""
    key = store.keys.resources_log
    wanted = await policy_cut(store.redis, key, max_age_s, max_count, now_ms)
    if wanted is None:
        return 0
    floor = await _needed_from(store, set(doomed_versions))
    cut = wanted if floor is None else min(wanted, floor)
    cut = lower(cut, await archived_cut(store.redis, store.keys.archived, key))  # what is not archived stays
    doomed: list[tuple[str, int]] = []  # (resources id, version) of the entries below the cut
    entries, start = 0, "-"
    while page := await store.redis.xrange(key, min=start, max=f"({format_id(cut)}", count=PAGE):
        entries += len(page)
        for _entry_id, fields in page:
            update = _decode(fields, store.max_record_bytes)
            if update is not None:
                doomed.append((update.resources_id, update.version))
        last = page[-1][0]
        start = "(" + (last.decode() if isinstance(last, bytes) else last)
    if dry_run or not entries:
        return entries
    await _drop_versions(store, doomed)  # the hash fields first: a crash leaves entries to redo
    return int(await store.redis.xtrim(key, minid=format_id(cut), approximate=False))


async def _needed_from(store: RedisStore, doomed: set[str]) -> StreamId | None:
    """The id of the oldest entry the module docstring says stays; None: the log is empty."""
    from fulmen.versions.retention import served_versions

    stored = [(_text(m), int(score)) for m, score in
              await store.redis.zrange(store.keys.stored_versions, 0, -1, withscores=True)]
    stored_floor = min((v for m, v in stored if m not in doomed), default=None)  # a resources version
    wanted = await served_versions(store)
    want_any = True  # the newest entry naming any model version
    oldest: StreamId | None = None
    before = "+"
    while page := await store.redis.xrevrange(store.keys.resources_log, max=before, count=PAGE):
        for raw_id, fields in page:
            entry_id = parse_id(raw_id)
            oldest = oldest or entry_id  # the newest entry stays
            update = _decode(fields, store.max_record_bytes)
            if update is None:
                continue
            if stored_floor is not None and update.version >= stored_floor:
                oldest = entry_id  # still in the part the stored versions need
            named = _named_version(update)
            if named is not None and (want_any or named in wanted):
                oldest, want_any = entry_id, False
                wanted.discard(named)
            elif not want_any and not wanted and (stored_floor is None or update.version < stored_floor):
                return oldest  # older than everything needed: look no further
        if len(page) < PAGE:
            break
        last = page[-1][0]
        before = "(" + (last.decode() if isinstance(last, bytes) else last)
    return oldest


async def _drop_versions(store: RedisStore, doomed: list[tuple[str, int]]) -> None:
    """Delete these versions from their resources hashes, except each id's latest."""
    ids = sorted({rid for rid, _ in doomed})
    pipe = store.redis.pipeline(transaction=False)
    for rid in ids:
        pipe.hget(store.keys.resources(rid), "latest")
    latest = {rid: int(v or 0) for rid, v in zip(ids, await pipe.execute(), strict=True)}
    pipe = store.redis.pipeline(transaction=False)
    for rid, version in doomed:
        if version != latest[rid]:
            pipe.hdel(store.keys.resources(rid), str(version))
    await pipe.execute()


def _decode(fields: Any, max_bytes: int) -> ResourcesUpdate | None:
    try:
        return ResourcesUpdate.from_wire(fields.get(b"m"), max_bytes)
    except RecordError:
        return None  # an unreadable entry holds nothing anyone needs


def _named_version(update: ResourcesUpdate) -> str | None:
    llm = update.resources.get("llm")
    version = llm.get("model_version") if isinstance(llm, dict) else None
    return version if isinstance(version, str) and version else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
