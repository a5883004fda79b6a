"""The Lua scripts that store spans: a call's spans as one value with their dedupe keys
(`store_spans`), on their own (ADD_SPANS, also the heartbeat) or with the attempt's end
(FINISH_WITH_SPANS). Kept apart from `fulmen.store.lua.scripts`, whose prelude and `finish` they share,
under the same contract (KEYS[1] the shard's prefix, ARGV values only)."""

from __future__ import annotations

from fulmen.store.lua.scripts import PRELUDE, joinable

# Store the spans of one call of rollout `rid`: `args` its arguments (the script's ARGV, or one joined
# call's), args[first] = their records as one value
# (`fulmen.records.spans.pack_span_batch`), args[first + 1..] = their dedupe keys, distinct, in order
# (the caller drops repeats within the call). They are numbered after `seq`, the rollout's counter,
# and written as ONE stream entry with ONE field under the id "<last seq>-0"
# (`fulmen.records.spans.entry_records` reads it back): Redis's cost is per value and per command,
# not per byte. The dedupe keys go into the rollout's set in one SADD; they are looked up first only
# if the rollout has stored spans before (a rollout's first spans can repeat none).
# Returns the counter after them, or nil and the positions (1-based) of the keys already stored: then
# nothing is written, and the caller sends the call again without those spans.
_SPANS = """
local function store_spans(args, rid, first, seq)
  local ids, n = K_SPAN_IDS .. rid, #args - first
  if n <= 0 then return seq end
  if seq > 0 then
    local dups = {}
    for chunk = first + 1, #args, 1000 do
      local seen = redis.call('SMISMEMBER', ids, unpack(args, chunk, math.min(chunk + 999, #args)))
      for j, s in ipairs(seen) do
        if s == 1 then dups[#dups + 1] = chunk + j - 1 - first end
      end
    end
    if #dups > 0 then return nil, dups end
  end
  redis.call('XADD', K_SPANS .. rid, (seq + n) .. '-0', 'z', args[first])
  for chunk = first + 1, #args, 1000 do
    redis.call('SADD', ids, unpack(args, chunk, math.min(chunk + 999, #args)))
  end
  return seq + n
end
"""

# ARGV[1] = rollout id, ARGV[2] = attempt id, ARGV[3..] = spans as `store_spans` takes them (none:
# a heartbeat). Stores the spans after the rollout's counter and counts as a heartbeat of the attempt.
# Returns {rollout status, attempt status, counter after the spans}, {'dup', positions...} (nothing
# stored or touched: see `store_spans`), or {'missing'} for an unknown attempt. Joinable (ADD_SPANS_JOINED).
ADD_SPANS, ADD_SPANS_JOINED = joinable(
    PRELUDE + _SPANS,
    """
local rid, aid = ARGV[1], ARGV[2]
local a = redis.call('HMGET', K_ATTEMPT .. aid, 'rollout_id', 'status')
if a[1] ~= rid then return {'missing'} end
local rk, seq = K_ROLLOUT .. rid, 0
if #ARGV > 2 then
  local before = tonumber(redis.call('HGET', rk, 'seq')) or 0
  local dups
  seq, dups = store_spans(ARGV, rid, 3, before)
  if dups then
    table.insert(dups, 1, 'dup')
    return dups
  end
  if seq ~= before then redis.call('HSET', rk, 'seq', seq) end
end
local attempt_status, rollout_status = touch(rid, aid, now(), a[2])
return {rollout_status or redis.call('HGET', rk, 'status'), attempt_status, seq}
"""
)

# FINISH_ATTEMPT with the attempt's last spans in the same step (one round trip where a runner would
# otherwise need two, and no window in which the attempt has ended without them).
# ARGV[1..7] as FINISH_ATTEMPT, ARGV[8..] = spans as `store_spans` takes them.
# Returns the code of `finish` ('missing' for an unknown attempt; then no span is stored), or
# {'dup', positions...} (nothing stored, the attempt not ended: see `store_spans`). Joinable
# (FINISHES_WITH_SPANS).
FINISH_WITH_SPANS, FINISHES_WITH_SPANS = joinable(
    PRELUDE + _SPANS,
    """
local rid, aid = ARGV[1], ARGV[2]
-- The rollout is read once, for the span counter and for `finish`, which writes the counter back.
local fields = {unpack(READ_FOR_FINISH)}
fields[#fields + 1] = 'seq'
local r = redis.call('HMGET', K_ROLLOUT .. rid, unpack(fields))
local astatus = current_status(r, aid)
if not astatus then
  local a = redis.call('HMGET', K_ATTEMPT .. aid, 'rollout_id', 'status')
  if a[1] ~= rid then return 'missing' end
  astatus = a[2]
end
local before = tonumber(r[#fields]) or 0
local seq, dups = store_spans(ARGV, rid, 8, before)
if dups then
  table.insert(dups, 1, 'dup')
  return dups
end
return finish(rid, aid, ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], astatus, r, seq ~= before and {'seq', seq} or nil)
"""
)
