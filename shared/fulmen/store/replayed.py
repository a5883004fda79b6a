"""Appending a replay's samples (`fulmen replay`) to the samples stream, once per rollout and replay.

One script checks the set ``replayed:<name>`` and appends in one step. More: docs/design/adapter.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

from fulmen.store.redis_store import RedisStore

# KEYS[1] = the samples stream, KEYS[2] = the replay's set; ARGV[1] = msgpack [[rollout id, [records]], ...].
# Returns, per rollout, the records appended (0: this replay appended them before).
APPEND_REPLAYED = """
local batch = cmsgpack.unpack(ARGV[1])
local out = {}
for i, item in ipairs(batch) do
  if redis.call('SADD', KEYS[2], item[1]) == 1 then
    for j = 1, #item[2] do redis.call('XADD', KEYS[1], '*', 'm', item[2][j]) end
    out[i] = #item[2]
  else
    out[i] = 0
  end
end
return out
"""


class ReplayWriter:
    """Appends one named replay's records; make one per replay run (it registers its script)."""

    def __init__(self, store: RedisStore, name: str) -> None:
        self.keys = [store.keys.samples, store.keys.replayed(name)]
        self._script = store.ctx.script(APPEND_REPLAYED)

    async def append(self, batch: Sequence[tuple[str, Sequence[bytes]]]) -> list[int]:
        if not batch:
            return []
        # use_bin_type=False: raw strings, the type Redis's cmsgpack reads
        payload = msgpack.packb([[rid, list(records)] for rid, records in batch], use_bin_type=False)
        return [int(n) for n in await self._script(keys=self.keys, args=[payload])]
