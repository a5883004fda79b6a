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


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=1, ensure_ascii=False, default=str)


_env = Environment(
    loader=PackageLoader("fulmen_dashboard", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    undefined=StrictUndefined,  # a template that names a missing value fails its test, not silently
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters.update(when=_when, num=_num, pretty=_pretty)


def render(template: str, **context: Any) -> bytes:
    return _env.get_template(template).render(**context).encode()
