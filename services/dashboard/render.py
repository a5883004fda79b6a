"""Pages from Jinja2 templates shipped in the package, every value HTML-escaped (autoescape): span
attributes, agent messages and rollout inputs are whatever an agent wrote."""

from __future__ import annotations

import json
import math
import time
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

PREVIEW_CHARS = 2000  # of a JSON value shown inline; the rest is behind "more"


def _when(value: float | None) -> str:
    if value is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "-" if not math.isfinite(value) else f"{value:.{digits}g}" if abs(value) < 1e-3 else f"{value:.{digits}f}"
    return str(value)


def _served(value: Any) -> str:
    """A validation pass's ``served_by`` (model version -> tasks) as "v5 ×30, no answer ×2", most first
    ("none" counts the tasks that failed or recorded no version)."""
    if not isinstance(value, dict) or not value:
        return "-" if not value else str(value)
    counts = sorted(value.items(), key=lambda item: (-item[1] if isinstance(item[1], int) else 0, str(item[0])))
    return ", ".join(f"{'no answer' if version == 'none' else version} ×{n}" for version, n in counts)


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=1, ensure_ascii=False, default=str)


_env = Environment(
    loader=PackageLoader("fulmen_dashboard", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    undefined=StrictUndefined,  # a template that names a missing value fails its test, not silently
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters.update(when=_when, num=_num, pretty=_pretty, served=_served)


def render(template: str, **context: Any) -> bytes:
    return _env.get_template(template).render(**context).encode()
