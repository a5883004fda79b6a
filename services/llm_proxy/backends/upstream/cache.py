"""An optional in-memory cache of temperature-0 upstream responses, keyed on the normalised request.

A hit answers a copy with a fresh ``id``. The key, the bounds and why not Redis: docs/design/proxy.md.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

OPENAI_DEFAULTS: Mapping[str, Any] = {
    "n": 1, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False,
    "parallel_tool_calls": True,
}  # fmt: skip
MAX_BYTES = 64 << 20  # answers held in all, whatever the entry bound: long answers do not fill the memory
IGNORED = frozenset({"stream", "stream_options", "user", "metadata", "store", "service_tier"})


def request_key(path: str, body: Mapping[str, Any], defaults: Mapping[str, Any] = OPENAI_DEFAULTS) -> str | None:
    """The cache key of a request, or None when it is not cacheable (not temperature 0, streaming)."""
    temperature = body.get("temperature")
    if body.get("stream") or isinstance(temperature, bool) or temperature != 0:
        return None
    normal = {**defaults, **{k: v for k, v in body.items() if v is not None and k not in IGNORED}}
    if isinstance(normal.get("stop"), str):
        normal["stop"] = [normal["stop"]]
    text = json.dumps(normal, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{path}\n{text}".encode()).hexdigest()


class ResponseCache:
    def __init__(self, max_entries: int, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> dict[str, Any] | None:
        """A fresh copy of the cached answer (the caller may change it), or None."""
        raw = self._entries.get(key)
        if raw is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        body: dict[str, Any] = json.loads(raw)
        if isinstance(body.get("id"), str):
            body["id"] = f"{body['id']}-cached-{uuid.uuid4().hex[:8]}"
        return body

    def put(self, key: str, raw: bytes) -> None:
        if len(raw) > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        self.bytes += len(raw) - (len(old) if old is not None else 0)
        self._entries[key] = raw
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= len(dropped)
