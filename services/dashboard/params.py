"""Path parts and query parameters, checked before anything reaches Redis: a bad one is a 400."""

from __future__ import annotations

import math
from datetime import UTC, datetime

from fulmen import keys as k
from fulmen.errors import InvalidInput
from fulmen.records.status import RolloutMode, RolloutStatus
from fulmen.store.browse import MAX_PAGE, Cursor, RolloutFilter
from fulmen_dashboard.http import HttpError, Request

DEFAULT_PAGE = 50
FILTER_PARAMS = frozenset({"status", "mode", "min_reward", "max_reward", "version", "since", "until", "limit", "cursor"})


def experiment(request: Request) -> str:
    try:
        return k.check_experiment(request.params["experiment"])
    except InvalidInput as e:
        raise HttpError(400, str(e)) from None


def identifier(request: Request, name: str, kind: str) -> str:
    try:
        return k.check_id(kind, request.params[name])
    except InvalidInput as e:
        raise HttpError(400, str(e)) from None


def _number(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise HttpError(400, f"{name} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise HttpError(400, f"{name} must be a finite number, got {text!r}")
    return value


def _time(name: str, text: str) -> float:
    """Seconds since the epoch, or an ISO date and time (UTC unless it says otherwise)."""
    try:
        return _number(name, text)
    except HttpError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise HttpError(400, f"{name} must be seconds since the epoch or an ISO date, got {text!r}") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def integer(request: Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None or text == "":
        return default
    if not text.isdigit() or len(text) > 9:
        raise HttpError(400, f"{name} must be a whole number between {low} and {high}, got {text!r}")
    value = int(text)
    if not low <= value <= high:
        raise HttpError(400, f"{name} must be between {low} and {high}, got {value}")
    return value


def rollout_filter(request: Request) -> tuple[RolloutFilter, int, Cursor | None]:
    """The rollout list's filter, page size and cursor. Unknown parameters are refused too: a typo in
    a filter must not silently show everything."""
    q = request.query
    unknown = sorted(set(q) - FILTER_PARAMS)
    if unknown:
        raise HttpError(400, f"unknown parameter(s) {unknown}; known: {sorted(FILTER_PARAMS)}")
    statuses = set()
    for part in filter(None, q.get("status", "").split(",")):
        try:
            statuses.add(RolloutStatus(part))
        except ValueError:
            raise HttpError(400, f"status {part!r} unknown; use {', '.join(s.value for s in RolloutStatus)}") from None
    mode = None
    if q.get("mode"):
        try:
            mode = RolloutMode(q["mode"])
        except ValueError:
            raise HttpError(400, f"mode {q['mode']!r} unknown; use train, val or test") from None
    try:
        where = RolloutFilter(
            frozenset(statuses), mode,
            _number("min_reward", q["min_reward"]) if q.get("min_reward") else None,
            _number("max_reward", q["max_reward"]) if q.get("max_reward") else None,
            q.get("version") or None,
            _time("since", q["since"]) if q.get("since") else None,
            _time("until", q["until"]) if q.get("until") else None,
        )
        cursor = Cursor.decode(q["cursor"]) if q.get("cursor") else None
    except InvalidInput as e:
        raise HttpError(400, str(e)) from None
    return where, integer(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE), cursor
