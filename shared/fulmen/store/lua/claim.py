"""The claim script: read a shard's queues and begin an attempt for each entry, in one round trip,
taking the priority lanes in the order of the claim rule (documented in `fulmen.store.queue`).

Kept apart from `fulmen.store.lua.scripts`, whose prelude and `begin` it shares, since it is the one script
that knows the rule."""

from __future__ import annotations

from fulmen import keys as k
from fulmen.codec import SCHEMA_VERSION
from fulmen.store.lua.scripts import BEGIN, PRELUDE

# The claim rule across priority lanes: position t of a cycle of CLAIM_CYCLE entries delivered from one
# shard's queues tries the lanes in CLAIM_ORDER[t] (lane names, first choice first). Documented, with
# what it guarantees, in docs/design/store.md.
CLAIM_ORDER: tuple[tuple[str, ...], ...] = (
    ("urgent", "normal", "low"),
    ("urgent", "normal", "low"),
    ("urgent", "normal", "low"),
    ("normal", "urgent", "low"),
    ("urgent", "normal", "low"),
    ("urgent", "normal", "low"),
    ("urgent", "normal", "low"),
    ("low", "urgent", "normal"),
)
CLAIM_CYCLE = len(CLAIM_ORDER)
_claim_orders = ", ".join(
    "{" + ", ".join(str(k.LANES.index(lane) + 1) for lane in order) + "}" for order in CLAIM_ORDER
)

# ARGV[1] = worker id, ARGV[2] = most entries to read.
# Reads new queue entries for the worker (XREADGROUP inside the script, so it never blocks) and
# begins an attempt for each as BEGIN_ATTEMPTS does: read and claim in one round trip instead of two.
# The read is NOACK: the attempt is begun in the same atomic step, so the entry needs no pending
# record (which would cost an XCLAIM in the AOF per entry, then an XACK).
# While the urgent and low lanes are empty (their length is what waits there, see `done`) it reads the
# normal lane alone, in one XREADGROUP, as before lanes; otherwise one entry at a time, each from the
# first lane with an entry in the order of its cycle position (CLAIM_ORDER; the position, K_TURN,
# moves on by one per entry read).
# The rollout id comes from the entry's msgpack record, decoded with the cmsgpack library that Redis
# builds into its Lua; the record is checked as `QueueEntry.from_wire` checks it.
# Returns {claimed, leftover, n}: claimed holds BEGIN_ATTEMPTS' 'ok' items;
# leftover the raw entries {lane, id, {field, value, ...}} it could not claim (unreadable record,
# missing rollout), for the caller to dead-letter (they point at no work: a caller that dies first
# loses only the poison entry); n the number of entries read (0: the
# queues had nothing new). Stale entries are acked and skipped.
CLAIM_NEXT = (
    PRELUDE
    + BEGIN
    + """
local mp = cmsgpack
local worker, count = ARGV[1], tonumber(ARGV[2])
local claimed, leftover, n = {}, {}, 0

-- A lane whose group is gone (the experiment was deleted under us) fails the read: raised while the
-- script has claimed nothing (the caller creates the groups again), else that lane counts as empty
-- this time, so attempts already begun are not lost with the reply.
local function read(lane, c)
  local reply = redis.pcall('XREADGROUP', 'GROUP', GROUP, worker, 'COUNT', c, 'NOACK', 'STREAMS', LANE_QUEUES[lane], '>')
  if type(reply) == 'table' and reply.err then
    if #claimed == 0 then error(reply.err) end
    return nil
  end
  return reply and reply[1][2] or nil
end

local function take(lane, entry)
  local fields, rid = entry[2], nil
  for i = 1, #fields, 2 do
    if fields[i] == 'm' then
      local decoded, rec = pcall(mp.unpack, fields[i + 1])
      if decoded and type(rec) == 'table' and rec.v == SCHEMA_VERSION and rec.kind == 'queue'
          and type(rec.rollout_id) == 'string' then
        rid = rec.rollout_id
      end
    end
  end
  local result = rid and begin(worker, entry[1], rid, lane, true) or {'missing'}
  if result[1] == 'ok' then
    claimed[#claimed + 1] = result
  elseif result[1] == 'missing' then
    leftover[#leftover + 1] = {lane, entry[1], fields}
  end
end

local lanes_waiting = 0
for lane = 1, #LANE_QUEUES do
  if lane ~= NORMAL then lanes_waiting = lanes_waiting + redis.call('XLEN', LANE_QUEUES[lane]) end
end
if lanes_waiting == 0 then
  local entries = read(NORMAL, count)
  if not entries then return {claimed, leftover, 0} end
  for _, entry in ipairs(entries) do take(NORMAL, entry) end
  return {claimed, leftover, #entries}
end

local ORDER = {CLAIM_ORDERS}
local turn = tonumber(redis.call('GET', K_TURN) or '0')
local empty = {}  -- lanes found with nothing new: nothing arrives while the script runs
while n < count do
  local got = false
  for _, lane in ipairs(ORDER[turn % #ORDER + 1]) do
    if not empty[lane] then
      local entries = read(lane, 1)
      if entries then take(lane, entries[1]); got = true; break end
      empty[lane] = true
    end
  end
  if not got then break end
  n = n + 1
  turn = (turn + 1) % #ORDER
end
if n > 0 then redis.call('SET', K_TURN, turn) end
return {claimed, leftover, n}
""".replace("SCHEMA_VERSION", str(SCHEMA_VERSION)).replace("CLAIM_ORDERS", _claim_orders)
)
