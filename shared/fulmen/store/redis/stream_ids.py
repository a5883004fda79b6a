"""Stream-id arithmetic that Redis leaves to clients (which entries a group has fully consumed)."""

from __future__ import annotations

from typing import Any

StreamId = tuple[int, int]


def parse_id(value: bytes | str) -> StreamId:
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def format_id(value: StreamId) -> str:
    return f"{value[0]}-{value[1]}"


def next_id(value: StreamId) -> StreamId:
    return value[0], value[1] + 1


def consumed_below(
    groups: list[dict[str, Any]], first_pending: dict[str, StreamId | None]
) -> StreamId | None:
    """The smallest id that some group still needs; every entry below it is acknowledged by all groups.

    A group needs every entry after its last-delivered id, and every entry still pending in it.
    With no group at all nothing counts as consumed (None), so an unread stream is never trimmed.
    """
    if not groups:
        return None
    cut: StreamId | None = None
    for g in groups:
        name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
        needed = next_id(parse_id(g["last-delivered-id"]))
        pending = first_pending.get(name)
        if pending is not None and pending < needed:
            needed = pending
        cut = needed if cut is None or needed < cut else cut
    return cut
