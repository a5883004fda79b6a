"""The Lua scripts of the data side: the adapter's bulk read and write of samples, and publishing
resources. The same contract as `fulmen.store.lua.scripts` (KEYS[1] is the prefix, every key derived from
it, one slot)."""

from __future__ import annotations

from fulmen import keys as k
from fulmen.store.lua.scripts import PRELUDE

# The adapter's write, for a whole batch of rollouts, and the acknowledgement of the finished-stream
# entries it came from. ARGV[1] = msgpack array, per rollout [rollout id, {stat counter: increment},
# [sample records], optional model version that served its last LLM call]; ARGV[2] = consumer group on the finished stream ('' = acknowledge nothing),
# ARGV[3..] = finished entry ids to acknowledge once the samples are written.
# Once per rollout: the rollout's 'sampled' field is the marker, set in the same step as its samples,
# so a redelivered entry (or a second adapter racing) appends nothing; the acknowledgement is in the
# same step too, so a crash can never leave samples written and their entry pending.
# One msgpack argument, not one argument per record: redis-py builds a command's RESP in Python, one
# argument at a time, and the counters are summed here and written once a batch.
# Returns, per rollout, the number of records appended: 0 if sampled before, -1 if the rollout is gone.
APPEND_SAMPLES = (
    PRELUDE
    + f"""
local stats, samples = P .. '{k.ADAPTER_STATS}', P .. '{k.SAMPLES}'
local batch = cmsgpack.unpack(ARGV[1])
local out, totals = {{}}, {{}}
for i, item in ipairs(batch) do
  local rk, records = K_ROLLOUT .. item[1], item[3]
  if redis.call('EXISTS', rk) == 0 then
    out[i] = -1
  elseif redis.call('HSETNX', rk, 'sampled', 1) == 0 then
    out[i] = 0
  else
    for name, increment in pairs(item[2]) do totals[name] = (totals[name] or 0) + increment end
    for j = 1, #records do redis.call('XADD', samples, '*', 'm', records[j]) end
    if item[4] and item[4] ~= '' then redis.call('HSET', rk, 'model_version', item[4]) end
    out[i] = #records
  end
end
for name, total in pairs(totals) do redis.call('HINCRBY', stats, name, total) end
if ARGV[2] ~= '' and #ARGV > 2 then
  for first = 3, #ARGV, 4000 do  -- unpack() has a limit on the number of values
    redis.call('XACK', K_FINISHED, ARGV[2], unpack(ARGV, first, math.min(first + 3999, #ARGV)))
  end
end
return out
"""
)

# The adapter's read of a whole batch, all but the spans: ARGV[1..] = rollout ids. Returns, per
# rollout, {} if it is gone, else {status, latest attempt id, mode, metadata, input, reward}. The
# spans are read in the same MULTI by one native XREAD over the rollouts' span streams
# (`fulmen.store.samples`): an XRANGE inside Lua would copy every span record into Lua strings and
# back, several times the server's CPU of the native read (bench/RESULTS.md).
READ_FOR_SAMPLES = (
    PRELUDE
    + """
local out = {}
for i = 1, #ARGV do
  local r = redis.call('HMGET', K_ROLLOUT .. ARGV[i], 'status', 'attempt_id', 'mode', 'metadata', 'input', 'reward')
  if r[1] then
    out[i] = {r[1], r[2] or '', r[3] or '', r[4] or '', r[5] or '', r[6] or ''}
  else
    out[i] = {}
  end
end
return out
"""
)

# Publish resources version ARGV[2] of id ARGV[1] (record ARGV[3]) if the version counter is still
# ARGV[2] - 1; ARGV[4] = '1' if the id must be new. Returns 'ok', 'exists', or 'stale' (another
# publisher took the version: read the counter and build the record again).
PUBLISH_RESOURCES = f"""
local P = KEYS[1]
local counter, res = P .. '{k.RESOURCES_VERSION}', P .. '{k.RESOURCES}' .. ARGV[1]
local version = tonumber(ARGV[2])
if (tonumber(redis.call('GET', counter)) or 0) ~= version - 1 then return 'stale' end
if ARGV[4] == '1' and redis.call('EXISTS', res) == 1 then return 'exists' end
redis.call('SET', counter, version)
redis.call('HSET', res, ARGV[2], ARGV[3], 'latest', version)
redis.call('XADD', P .. '{k.RESOURCES_LOG}', '*', 'm', ARGV[3])
return 'ok'
"""

# APPEND_SAMPLES for an experiment with several shards (`fulmen.store.samples`): KEYS[1] = shard 0's
# prefix, ARGV[1] = msgpack array, per rollout [rollout id, {stat counter: increment}, [records]].
# The once-per-rollout marker is the set `sampled` in this slot; the caller checked the rollouts exist
# and acknowledges the finished entries after. Returns, per rollout, the records appended (0: before).
APPEND_SAMPLES_MARKED = f"""
local P = KEYS[1]
local stats, samples, marked = P .. '{k.ADAPTER_STATS}', P .. '{k.SAMPLES}', P .. '{k.SAMPLED}'
local batch = cmsgpack.unpack(ARGV[1])
local out, totals = {{}}, {{}}
for i, item in ipairs(batch) do
  if redis.call('SADD', marked, item[1]) == 0 then
    out[i] = 0
  else
    for name, increment in pairs(item[2]) do totals[name] = (totals[name] or 0) + increment end
    for j = 1, #item[3] do redis.call('XADD', samples, '*', 'm', item[3][j]) end
    out[i] = #item[3]
  end
end
for name, total in pairs(totals) do redis.call('HINCRBY', stats, name, total) end
return out
"""
