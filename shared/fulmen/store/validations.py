"""Validation passes: one JSON record per pass of a model version (its label, step, accuracy and
scores), appended by the algorithm or the evaluator, read by the run's report, `fulmen status` and
the dashboard. A pass run twice (a job requeued while its first run was still alive) counts once."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fulmen.store.context import StoreContext


class Validations:
    """Part of the store: the experiment's validation passes, in the order they were recorded."""

    def __init__(self, ctx: StoreContext) -> None:
        self.redis = ctx.redis
        self.keys = ctx.keys

    async def append(self, result: Mapping[str, Any]) -> None:
        await self.redis.xadd(self.keys.validations, {"m": json.dumps(result)})

    async def passes(self, newest: int | None = None) -> list[dict[str, Any]]:
        """The passes, oldest first, one per label (its first record); with ``newest``, only among
        the newest that many records. An entry that is not a JSON object is skipped."""
        if newest is None:
            entries = await self.redis.xrange(self.keys.validations)
        else:
            entries = list(reversed(await self.redis.xrevrange(self.keys.validations, count=newest)))
        by_label: dict[str, dict[str, Any]] = {}
        for _, fields in entries:
            try:
                result = json.loads(fields[b"m"])
            except (KeyError, ValueError):
                continue
            if isinstance(result, dict):
                by_label.setdefault(str(result.get("label")), result)
        return list(by_label.values())
