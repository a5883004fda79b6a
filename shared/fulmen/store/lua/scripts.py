"""The Lua scripts behind every transition that touches several keys, so each is atomic.

KEYS[1] is the experiment prefix and every key a script touches is derived from it (one slot on
Redis Cluster); time is the server's. The contract and why: docs/design/store.md.
"""

from __future__ import annotations

from fulmen import keys as k
from fulmen.records.status import ACTIVE_ATTEMPT, TERMINAL_ROLLOUT, WAITING_ROLLOUT, lua_set

_lane_queues = ", ".join(f"P .. '{k.LANE_QUEUES[lane]}'" for lane in k.LANES)
_lane_of = ", ".join(f"{lane} = {i + 1}" for i, lane in enumerate(k.LANES))

PRELUDE = f"""
local P = KEYS[1]
local K_ROLLOUT, K_ATTEMPT, K_SPANS, K_SPAN_IDS, K_STATUS =
  P .. '{k.ROLLOUT}', P .. '{k.ATTEMPT}', P .. '{k.SPANS}', P .. '{k.SPAN_IDS}', P .. '{k.STATUS}'
local K_FINISHED, K_INDEX = P .. '{k.FINISHED}', P .. '{k.ROLLOUT_INDEX}'
-- The queue stream of each priority lane, highest first (lane numbers are 1-based positions in
-- `fulmen.keys.LANES`); a rollout's lane is its hash's 'priority' (none: stored before lanes, normal).
local LANE_QUEUES = {{{_lane_queues}}}
local LANE_OF = {{{_lane_of}}}
local NORMAL = LANE_OF['{k.DEFAULT_LANE}']
local K_TURN = P .. '{k.QUEUE_TURN}'
local function lane_of(priority) return LANE_OF[priority] or NORMAL end
local K_HEARTBEAT, K_DEADLINE = P .. '{k.WATCH_HEARTBEAT}', P .. '{k.WATCH_DEADLINE}'
local GROUP = '{k.RUNNERS_GROUP}'

local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

{lua_set("TERMINAL", TERMINAL_ROLLOUT)}
{lua_set("WAITING", WAITING_ROLLOUT)}
{lua_set("ACTIVE", ACTIVE_ATTEMPT)}

-- Move a rollout to a new status: the hash field and the per-status index change together. The
-- field/value pairs in `...` go into the same HSET (one write of the hash, not one per field), and are
-- written even when the status does not change.
local function set_status(rid, old, new, ...)
  if old == new then
    if select('#', ...) > 0 then redis.call('HSET', K_ROLLOUT .. rid, ...) end
    return
  end
  -- One SMOVE where it can (a command, an AOF line); SADD if the id was not in the old set.
  if not old or redis.call('SMOVE', K_STATUS .. old, K_STATUS .. new, rid) == 0 then
    redis.call('SADD', K_STATUS .. new, rid)
  end
  redis.call('HSET', K_ROLLOUT .. rid, 'status', new, ...)
end

-- Take an attempt off the watchdog's lists. `unresponsive_s`, `timeout_s`: its rollout's, when the
-- caller read them ('' = the rollout has none, so the attempt was never on that list: no ZREM).
local function unwatch(aid, unresponsive_s, timeout_s)
  if unresponsive_s ~= '' then redis.call('ZREM', K_HEARTBEAT, aid) end
  if timeout_s ~= '' then redis.call('ZREM', K_DEADLINE, aid) end
end

-- An active attempt showed life: refresh its heartbeat, preparing -> running (and its rollout).
-- `status`: the attempt's status when the caller has just read it (saves reading it again).
-- Returns the attempt's status, then the rollout's when it was read (nil if the attempt is not active).
local function touch(rid, aid, t, status)
  local ak = K_ATTEMPT .. aid
  status = status or redis.call('HGET', ak, 'status')
  if not ACTIVE[status] then return status end
  local r = redis.call('HMGET', K_ROLLOUT .. rid, 'status', 'attempt_id', 'unresponsive_s')
  if r[3] and r[3] ~= '' then redis.call('ZADD', K_HEARTBEAT, t + tonumber(r[3]), aid) end
  if status == 'preparing' then
    redis.call('HSET', ak, 'heartbeat_time', t, 'status', 'running')
    if r[2] == aid and r[1] == 'preparing' then
      set_status(rid, 'preparing', 'running')
      return 'running', 'running'
    end
    return 'running', r[1]
  end
  redis.call('HSET', ak, 'heartbeat_time', t)
  return status, r[1]
end

-- The status of attempt `aid` if the rollout (`r`: its status and attempt_id first) says it is its
-- current attempt and active, else nil (then read the attempt's hash). An active current attempt's
-- status is its rollout's: they change together (`begin`, `touch`, `set_status` in `finish`), and any
-- end of it moves the rollout out of preparing and running, or to another attempt. Saves a read of
-- the attempt on the path every finish takes.
local function current_status(r, aid)
  if r[2] == aid and ACTIVE[r[1]] then return r[1] end
  return nil
end

-- End an active attempt with `status` and apply the rollout's retry policy. `reward` ('' = none), the
-- attempt's final reward as its runner computed it, is stored with the attempt and, when the attempt
-- ends the rollout, with the rollout. `astatus`: the attempt's status if the caller has read it (nil:
-- read here). `r`: READ_FOR_FINISH of the rollout if the caller has read it (nil: read here).
-- `rset`: field/value pairs the caller wants written to the rollout hash in any case (FINISH_WITH_SPANS'
-- span counter), folded into the rollout's one HSET.
-- The retry policy counts the attempts that failed on their merits: `attempt_n` less those handed
-- back (`released_n`, SET_ROLLOUT_STATUS), which failed for the infrastructure (a runner stopping, an
-- unreachable LLM proxy), not for the agent.
-- Returns: missing | already | running | superseded | ignored | succeeded | requeued | failed
local READ_FOR_FINISH = {{'status', 'attempt_id', 'attempt_n', 'max_attempts', 'retry_on', 'unresponsive_s', 'timeout_s',
                         'priority', 'released_n'}}
local function finish(rid, aid, status, err, queue_msg, finished_msg, reward, astatus, r, rset)
  local ak, rk = K_ATTEMPT .. aid, K_ROLLOUT .. rid
  rset = rset or {{}}
  r = r or redis.call('HMGET', rk, unpack(READ_FOR_FINISH))
  astatus = astatus or current_status(r, aid) or redis.call('HGET', ak, 'status')
  if not astatus then return 'missing' end
  if not ACTIVE[astatus] then
    if #rset > 0 then redis.call('HSET', rk, unpack(rset)) end
    -- A newer attempt or a cancel ended this attempt before its worker reported: say which.
    if r[2] ~= aid then return 'superseded' end
    if r[1] == 'cancelled' then return 'ignored' end
    return 'already'
  end
  local t = now()
  if status == 'running' then
    if #rset > 0 then redis.call('HSET', rk, unpack(rset)) end
    touch(rid, aid, t, astatus)
    return 'running'
  end
  local has_reward = reward and reward ~= ''
  local af = {{'status', status, 'end_time', t}}
  if err ~= '' then af[#af + 1] = 'error'; af[#af + 1] = err end
  if has_reward then af[#af + 1] = 'reward'; af[#af + 1] = reward end
  redis.call('HSET', ak, unpack(af))
  unwatch(aid, r[6], r[7])  -- no rollout (nil fields): both lists, its config is unknown
  if r[2] ~= aid or TERMINAL[r[1]] then
    if #rset > 0 then redis.call('HSET', rk, unpack(rset)) end
    return r[2] ~= aid and 'superseded' or 'ignored'
  end
  local retry = status ~= 'succeeded' and string.find(',' .. r[5] .. ',', ',' .. status .. ',', 1, true)
  if retry and tonumber(r[3]) - (tonumber(r[9]) or 0) < tonumber(r[4]) then
    rset[#rset + 1] = 'qid'
    rset[#rset + 1] = redis.call('XADD', LANE_QUEUES[lane_of(r[8])], '*', 'm', queue_msg)
    set_status(rid, r[1], 'requeuing', unpack(rset))
    return 'requeued'
  end
  local ending = status == 'succeeded' and 'succeeded' or 'failed'
  rset[#rset + 1] = 'end_time'
  rset[#rset + 1] = t
  if has_reward then rset[#rset + 1] = 'reward'; rset[#rset + 1] = reward end
  set_status(rid, r[1], ending, unpack(rset))
  redis.call('XADD', K_FINISHED, '*', 'm', finished_msg)
  return ending
end
"""

# Create rollout `rid` as queuing from the hash fields in ARGV[first..last] at time `t`, in one HSET;
# queue it unless `queue_msg` is '' (start_rollout begins its attempt at once). `index`: nil to add
# the rollout to the status set and the rollout index now, else a table collecting the ids for the
# caller to add in one SADD and one ZADD (`index_all`). Returns 1, or 0 if the id existed (nothing changes).
_CREATE = """
local function create(rid, queue_msg, first, last, t, index)
  local rk = K_ROLLOUT .. rid
  if redis.call('EXISTS', rk) == 1 then return 0 end
  local fields = {unpack(ARGV, first, last)}
  local qid = ''
  if queue_msg ~= '' then
    local priority = nil
    for i = 1, #fields - 1, 2 do
      if fields[i] == 'priority' then priority = fields[i + 1] end
    end
    qid = redis.call('XADD', LANE_QUEUES[lane_of(priority)], '*', 'm', queue_msg)
  end
  for _, x in ipairs({'status', 'queuing', 'enqueue_time', t, 'seq', 0, 'attempt_n', 0, 'qid', qid}) do fields[#fields + 1] = x end
  redis.call('HSET', rk, unpack(fields))
  if index then
    index[#index + 1] = rid
  else
    redis.call('SADD', K_STATUS .. 'queuing', rid)
    redis.call('ZADD', K_INDEX, t, rid)
  end
  return 1
end

-- Add the rollouts `ids`, all created at `t`, to the queuing set and the rollout index (in chunks:
-- unpack() has a limit on the number of values).
local function index_all(ids, t)
  for first = 1, #ids, 1000 do
    local last = math.min(first + 999, #ids)
    redis.call('SADD', K_STATUS .. 'queuing', unpack(ids, first, last))
    local scored = {}
    for i = first, last do scored[#scored + 1] = t; scored[#scored + 1] = ids[i] end
    redis.call('ZADD', K_INDEX, unpack(scored))
  end
end
"""

# A batch of rollouts: ARGV = per rollout (id, queue message, n, then n values: field/value pairs of
# its hash). Returns, per rollout, 1 when created, 0 when the id already existed (idempotent enqueue:
# nothing changes). One call for the batch: the script's fixed cost and the clock read are paid once.
ENQUEUE = PRELUDE + _CREATE + """
local t, out, index, i = now(), {}, {}, 1
while i <= #ARGV do
  local n = tonumber(ARGV[i + 2])
  out[#out + 1] = create(ARGV[i], ARGV[i + 1], i + 3, i + 2 + n, t, index)
  i = i + 3 + n
end
index_all(index, t)
return out
"""

# Begin the next attempt of rollout `rid` for `worker`; `qid` is the queue entry it was claimed from
# ('' for a manual attempt), on the queue of lane number `lane`; `unpending`: the entry was read with
# NOACK (CLAIM_NEXT), so it has no pending entry to acknowledge. Returns one reply item of
# BEGIN_ATTEMPTS. Shared with CLAIM_NEXT.
# An entry done with is acknowledged; on the urgent and low lanes it is deleted too, so their length
# is what waits there and an empty lane costs the claim nothing (CLAIM_NEXT). The normal lane keeps
# its entries for retention to trim, as the queue always has.
BEGIN = """
local function done(lane, qid, unpending)
  if not unpending then redis.call('XACK', LANE_QUEUES[lane], GROUP, qid) end
  if lane ~= NORMAL then redis.call('XDEL', LANE_QUEUES[lane], qid) end
end

local function begin(worker, qid, rid, lane, unpending)
  local rk = K_ROLLOUT .. rid
  -- The whole hash, read once: its fields decide, and it goes back in the reply with the fields
  -- changed here appended (the reader's dict keeps the last value of a field).
  local h = redis.call('HGETALL', rk)
  if #h == 0 then return {'missing'} end
  local r = {}
  for i = 1, #h, 2 do r[h[i]] = h[i + 1] end
  if qid ~= '' and (r.qid ~= qid or not WAITING[r.status]) then
    done(lane, qid, unpending)
    return {'stale'}
  end
  if TERMINAL[r.status] then return {'terminal'} end
  local t = now()
  -- A manual attempt supersedes the active one, which must not keep running unseen.
  local prev_id = r.attempt_id or ''
  if prev_id ~= '' then
    local prev = K_ATTEMPT .. prev_id
    if ACTIVE[redis.call('HGET', prev, 'status')] then
      redis.call('HSET', prev, 'status', 'failed', 'end_time', t)
      unwatch(prev_id)
    end
  end
  local n = tonumber(r.attempt_n or '0') + 1
  local aid = rid .. '.' .. n
  local ak = K_ATTEMPT .. aid
  -- The attempt is new: its fields are exactly these, so the reply carries them without a read back
  -- (as strings, formatted as redis.call formats a number: a number in a reply would lose its fraction).
  local ts = string.format('%.17g', t)
  local attempt = {'v', '1', 'rollout_id', rid, 'attempt_id', aid, 'sequence_id', tostring(n),
                   'status', 'preparing', 'worker_id', worker, 'start_time', ts, 'heartbeat_time', ts,
                   'end_time', ''}
  redis.call('HSET', ak, unpack(attempt))
  local changed = {'attempt_n', tostring(n), 'attempt_id', aid, 'qid', ''}
  if (r.start_time or '') == '' then
    changed[#changed + 1] = 'start_time'
    changed[#changed + 1] = ts
  end
  set_status(rid, r.status, 'preparing', unpack(changed))
  h[#h + 1] = 'status'
  h[#h + 1] = 'preparing'
  for _, x in ipairs(changed) do h[#h + 1] = x end
  local unresponsive_s, timeout_s = r.unresponsive_s or '', r.timeout_s or ''
  if unresponsive_s ~= '' then redis.call('ZADD', K_HEARTBEAT, t + tonumber(unresponsive_s), aid) end
  if timeout_s ~= '' then redis.call('ZADD', K_DEADLINE, t + tonumber(timeout_s), aid) end
  if qid ~= '' then done(lane, qid, unpending) end
  return {'ok', h, attempt}
end
"""

# ARGV[1] = worker id, ARGV[2] = the lane number of the queue the entries came from ('' = normal),
# ARGV[3..] = pairs (queue entry id or '' for a manual attempt, rollout id).
# For each pair returns {code, rollout fields, attempt fields}; code is
#   ok       - a new attempt was created and is owned by the worker (the queue entry is acked);
#   missing  - no such rollout (the entry is left pending for the caller to dead-letter);
#   stale    - the entry no longer represents the rollout (already claimed, cancelled): acked, skipped;
#   terminal - a manual attempt was asked for a rollout that has finished.
BEGIN_ATTEMPTS = (
    PRELUDE
    + BEGIN
    + """
local out = {}
local lane = tonumber(ARGV[2]) or NORMAL
for i = 3, #ARGV, 2 do
  out[#out + 1] = begin(ARGV[1], ARGV[i], ARGV[i + 1], lane)
end
return out
"""
)

# ARGV[1] = worker id, ARGV[2] = rollout id, ARGV[3..] = field/value pairs of the rollout hash.
# Creates the rollout and begins its first attempt in one step (no queue entry), so a crash cannot
# leave a rollout that is queuing yet on no queue. Returns {'exists'} or BEGIN_ATTEMPTS' 'ok' item.
START_ROLLOUT = (
    PRELUDE
    + _CREATE
    + BEGIN
    + """
if create(ARGV[2], '', 3, #ARGV, now()) == 0 then return {'exists'} end
return begin(ARGV[1], '', ARGV[2])
"""
)


def joinable(head: str, body: str) -> tuple[str, str]:
    """A per-call script in two forms: itself, and its joined form, which runs it for several calls in
    one script call (`fulmen.store.redis.autopipeline.AutoPipeline.join`). The body becomes a function whose
    parameter is named ARGV, so it reads its own call's arguments unchanged. The joined form's ARGV is,
    per call, the count of its arguments and then those arguments; it returns the calls' replies in
    order, a failed call's error in its place. What a script call costs the server besides its
    commands (the dispatch, the prelude's closures, the reply, the MULTI/EXEC around its writes in the
    AOF) is then paid once for all of them (figures in bench/RESULTS.md)."""
    item = f"local function item(ARGV)\n{body}\nend\n"
    # Each call runs under pcall: Redis does not undo a failed script's writes, so an error in one call
    # must fail that call alone, not the calls before it whose writes stand (nor those after it).
    joined = """
local out, i = {}, 1
while i <= #ARGV do
  local n, args = tonumber(ARGV[i]), {}
  for j = 1, n do args[j] = ARGV[i + j] end
  local ok, reply = pcall(item, args)
  if not ok then
    reply = redis.error_reply(type(reply) == 'table' and reply.err or tostring(reply))
  elseif reply == nil then
    reply = false
  end
  out[#out + 1] = reply
  i = i + n + 1
end
return out
"""
    return head + item + "return item(ARGV)\n", head + item + joined


# ARGV[1] = rollout id, ARGV[2] = attempt id, ARGV[3] = new status (running or a terminal status),
# ARGV[4] = error message ('' = none), ARGV[5] = queue message (used on retry),
# ARGV[6] = finished message (used when the rollout ends), ARGV[7] = the attempt's reward ('' = none).
# Returns the code of `finish`. Joinable (FINISH_ATTEMPTS).
FINISH_ATTEMPT, FINISH_ATTEMPTS = joinable(
    PRELUDE,
    """
return finish(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
""",
)

# ARGV[1] = rollout id, ARGV[2] = attempt id, ARGV[3] = timeout | unresponsive,
# ARGV[4] = error message, ARGV[5] = queue message, ARGV[6] = finished message.
# Re-checks staleness with the server clock, so concurrent watchdogs transition an attempt once.
# Returns 'fresh' (not stale after all; its watch score is refreshed) or the code of `finish`.
EXPIRE_ATTEMPT = (
    PRELUDE
    + """
local rid, aid, kind = ARGV[1], ARGV[2], ARGV[3]
local a = redis.call('HMGET', K_ATTEMPT .. aid, 'status', 'start_time', 'heartbeat_time')
if not ACTIVE[a[1]] then unwatch(aid); return a[1] and 'already' or 'missing' end
local r = redis.call('HMGET', K_ROLLOUT .. rid, 'timeout_s', 'unresponsive_s')
local t = now()
local due
if kind == 'timeout' then
  if not r[1] or r[1] == '' then redis.call('ZREM', K_DEADLINE, aid); return 'fresh' end
  due = tonumber(a[2]) + tonumber(r[1])
  if due > t then redis.call('ZADD', K_DEADLINE, due, aid); return 'fresh' end
else
  if not r[2] or r[2] == '' then redis.call('ZREM', K_HEARTBEAT, aid); return 'fresh' end
  due = tonumber(a[3]) + tonumber(r[2])
  if due > t then redis.call('ZADD', K_HEARTBEAT, due, aid); return 'fresh' end
end
return finish(rid, aid, kind, ARGV[4], ARGV[5], ARGV[6], '', a[1])
"""
)

# ARGV[1] = rollout id, ARGV[2] = new status (succeeded | failed | cancelled | requeuing),
# ARGV[3] = error message for an attempt cut short, ARGV[4] = queue message,
# ARGV[5] = finished message, ARGV[6] (optional) = only if this attempt is the latest and active
# (a runner handing back its own attempt must not requeue a newer one). Such a hand-back to requeuing
# is counted in 'released_n', which `finish` leaves out of the attempts its retry policy counts.
# Returns 'missing', 'already' (terminal, already waiting, or not that attempt's), or the new status.
SET_ROLLOUT_STATUS = (
    PRELUDE
    + """
local rid, new = ARGV[1], ARGV[2]
local rk = K_ROLLOUT .. rid
local r = redis.call('HMGET', rk, 'status', 'attempt_id')
if not r[1] then return 'missing' end
if TERMINAL[r[1]] then return 'already' end
if new == 'requeuing' and WAITING[r[1]] then return 'already' end
if ARGV[6] and ARGV[6] ~= '' and (r[2] ~= ARGV[6]
    or not ACTIVE[redis.call('HGET', K_ATTEMPT .. ARGV[6], 'status')]) then
  return 'already'
end
local t = now()
if r[2] and r[2] ~= '' and ACTIVE[redis.call('HGET', K_ATTEMPT .. r[2], 'status')] then
  redis.call('HSET', K_ATTEMPT .. r[2], 'status', 'failed', 'end_time', t, 'error', ARGV[3])
  unwatch(r[2])
end
if new == 'requeuing' then
  local h = redis.call('HMGET', rk, 'priority', 'released_n')
  local qid = redis.call('XADD', LANE_QUEUES[lane_of(h[1])], '*', 'm', ARGV[4])
  if ARGV[6] and ARGV[6] ~= '' then
    set_status(rid, r[1], new, 'qid', qid, 'released_n', (tonumber(h[2]) or 0) + 1)
  else
    set_status(rid, r[1], new, 'qid', qid)
  end
else
  set_status(rid, r[1], new, 'qid', '', 'end_time', t)
  redis.call('XADD', K_FINISHED, '*', 'm', ARGV[5])
end
return new
"""
)

# KEYS[1] = a rollout or attempt hash. ARGV[1..] = field/value pairs.
# Sets the fields only if the hash exists. Returns 1 if set, 0 if the hash does not exist.
SET_FIELDS_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
