"""The judge's answer read: one score in [0, 1] and a reason per trajectory, or `Malformed` saying
what is wrong (which goes back to the judge when it is asked again)."""

from __future__ import annotations

import contextlib
import json
import math
import re
from typing import Any

from fulmen.rewards.verdict import Verdict

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
_ID_KEYS = ("trajectory", "id", "index")


class Malformed(ValueError):
    """The answer cannot be used; the message says why, to the judge and in the final error."""


def scores_in(text: str | None, n: int) -> list[Verdict]:
    """The ``n`` verdicts, in trajectory order."""
    entries = _entries(_json_in(text or ""))
    verdicts: dict[int, Verdict] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise Malformed(f"each entry of scores must be an object, got {entry!r}"[:200])
        number = next((entry[k] for k in _ID_KEYS if k in entry), None)
        if isinstance(number, str) and number.strip().isdigit():
            number = int(number)
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= n:
            raise Malformed(f"an entry's trajectory must be a number from 1 to {n}, got {number!r}")
        if number in verdicts:
            raise Malformed(f"trajectory {number} is scored twice")
        verdicts[number] = Verdict(_score(entry.get("score"), number), str(entry.get("reason", ""))[:500])
    missing = [i for i in range(1, n + 1) if i not in verdicts]
    if missing:
        raise Malformed(f"no score for trajectory {', '.join(map(str, missing))}")
    return [verdicts[i] for i in range(1, n + 1)]


def _json_in(text: str) -> Any:
    for candidate in (text.strip(), *_FENCE.findall(text)):
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    start = text.find("{")
    if start >= 0:
        try:
            return json.JSONDecoder().raw_decode(text, start)[0]
        except ValueError:
            pass
    raise Malformed("the answer holds no JSON object")


def _entries(value: Any) -> list[Any]:
    if isinstance(value, dict) and isinstance(value.get("scores"), list):
        return value["scores"]
    if isinstance(value, list):
        return value
    raise Malformed('the answer must be {"scores": [...]}')


def _score(value: Any, number: int) -> float:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Malformed(f"trajectory {number}'s score must be a number, got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise Malformed(f"trajectory {number}'s score {value} is not between 0 and 1")
    return float(value)
