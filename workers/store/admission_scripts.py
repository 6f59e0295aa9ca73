"""The Lua scripts behind `workers.store.admission.AdmissionStore`: cluster-wide admission of model calls.

Every per-model script takes the model's keys (`Keys.admission`, in `ADMISSION_PARTS` order), then the
processes' liveness hash and the models set (`KEYS[1..10]`), and starts its ARGV with the same header: the
model, its three limits (0: none), the hold TTL and the waiters' liveness TTL (ms), and the calling process's
presence token (`ARGV[1..7]`). Each script first drops what has expired (holds of a silent worker, calls older
than the 60 s window), then grants queued calls while capacity allows (`GRANT`), and ends by taking the calling
process's grants (`MINE`), so one round trip both asks and learns.

Fair share is start-time fair queuing: a queued call's tag is the larger of the virtual clock (the tag of the
last grant) and its session's previous finish tag; its finish tag is that plus 1/weight. Calls are granted in
tag order, so sessions take turns whatever the number of calls each has queued, a session with weight 2 getting
two turns to one. A session that had nothing queued starts at the clock: it never banks turns while idle.
"""

from __future__ import annotations

from typing import Final

from workers.store.script_parts import NOW, lua_script

WINDOW_MS: Final = 60_000  # rpm and tpm count what was admitted in the last minute (a sliding window)
MAX_GRANTS: Final = 256  # grants of one script call: a script's time stays bounded
ALIVE_KEPT: Final = 256  # processes in the liveness hash before the lapsed ones are pruned
TAGS_SLACK: Final = 64  # session tags kept beyond twice the queue's length before the stale ones are pruned

_HEADER = """
local holds, queue, waiters, tags, log, tokens, cooldown, granted = unpack(KEYS, 1, 8)
local alive, models = KEYS[9], KEYS[10]
local model, conc, rpm, tpm = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local hold_ttl, alive_ttl, me = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
"""

_TIDY = f"""
local function tidy()
  redis.call('ZREMRANGEBYSCORE', holds, '-inf', now)
  local old = redis.call('ZRANGEBYSCORE', log, '-inf', now - {WINDOW_MS})
  if #old == 0 then return end
  local spent = 0
  for _, id in ipairs(old) do spent = spent + tonumber(redis.call('HGET', tokens, id) or '0') end
  for i = 1, #old, 500 do redis.call('HDEL', tokens, unpack(old, i, math.min(i + 499, #old))) end
  redis.call('ZREMRANGEBYSCORE', log, '-inf', now - {WINDOW_MS})
  if redis.call('ZCARD', log) == 0 then redis.call('DEL', tokens)
  else redis.call('HINCRBY', tokens, '_sum', -spent) end
end
"""

# what keeps a call of `est` tokens to `endpoint` out now (a limit's word), or nil; a call estimated above the
# whole tpm goes out alone in an empty window rather than never
_BLOCKED = f"""
local TAGS_SLACK, WINDOW_MS = {TAGS_SLACK}, {WINDOW_MS}
local function blocked(endpoint, est)
  if tonumber(redis.call('HGET', cooldown, endpoint) or '0') > now then return COOLDOWN end
  if conc > 0 and redis.call('ZCARD', holds) >= conc then return CONCURRENCY end
  if rpm > 0 and redis.call('ZCARD', log) >= rpm then return RPM end
  if tpm > 0 and tonumber(redis.call('HGET', tokens, '_sum') or '0') + math.min(est, tpm) > tpm then return TPM end
  return nil
end

local function admit(id, est)
  redis.call('ZADD', holds, now + hold_ttl, id)
  if rpm > 0 or tpm > 0 then  -- the window is kept only for a model whose rates are bounded
    redis.call('ZADD', log, now, id)
    redis.call('HSET', tokens, id, est)
    redis.call('HINCRBY', tokens, '_sum', est)
    -- a model no longer called runs no script to tidy its window: the window goes on its own a minute later
    redis.call('PEXPIRE', log, WINDOW_MS + hold_ttl)
    redis.call('PEXPIRE', tokens, WINDOW_MS + hold_ttl)
  end
end

local function owner_of(id) return string.match(id, '^([^|]*)|') end

-- the hash is deleted only when the queue empties: while it never does, sessions passing through would pile up
-- in it. Past twice the queue's length (and a slack), the sessions with nothing queued go: each may then start
-- at the clock at most one turn early, and the hash stays about the size of the queue (amortized O(1) a call).
local function prune_tags()
  if redis.call('HLEN', tags) <= 2 * redis.call('ZCARD', queue) + TAGS_SLACK then return end
  local busy, entries, old = {{}}, redis.call('HGETALL', tags), {{}}
  for _, data in ipairs(redis.call('HVALS', waiters)) do busy['s:' .. cjson.decode(data).s] = true end
  for i = 1, #entries, 2 do
    if entries[i] ~= '_v' and not busy[entries[i]] then old[#old + 1] = entries[i] end
  end
  for i = 1, #old, 500 do redis.call('HDEL', tags, unpack(old, i, math.min(i + 499, #old))) end
end
"""

_GRANT = f"""
local function grant()
  for _ = 1, {MAX_GRANTS} do
    local head = redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
    if #head == 0 then redis.call('DEL', tags); return nil end
    local id, tag = head[1], head[2]
    local data, owner = redis.call('HGET', waiters, id), owner_of(id)
    if not data or tonumber(redis.call('HGET', alive, owner) or '0') < now then
      redis.call('ZREM', queue, id); redis.call('HDEL', waiters, id)  -- its process stopped looking
    else
      local w = cjson.decode(data)
      local why = blocked(w.e, w.t)
      if why then return why end
      redis.call('ZREM', queue, id); redis.call('HDEL', waiters, id)
      redis.call('HSET', tags, '_v', tag)
      admit(id, w.t)
      local before = redis.call('HGET', granted, owner)
      redis.call('HSET', granted, owner, before and (before .. '\\n' .. id) or id)
    end
  end
  return nil
end

local function mine()
  local ids = redis.call('HGET', granted, me)
  if not ids then return {{}} end
  redis.call('HDEL', granted, me)
  local out = {{}}
  for id in string.gmatch(ids, '[^\\n]+') do out[#out + 1] = id end
  return out
end
"""

_PARTS = (NOW, _HEADER, _TIDY, _BLOCKED, _GRANT)

# ARGV after the header: waiter id, parent session, token estimate, endpoint, weight. With nothing queued and
# capacity free the call is admitted at once (`granted`); else it is queued in fair order, queued calls are
# granted while capacity allows, and the reply says whether this one was. Reply: {word, now, the limit that
# holds the queue ('' when none), the caller's grants}.
ACQUIRE: Final = lua_script(
    *_PARTS,
    """
local id, session, est, endpoint, weight = ARGV[8], ARGV[9], tonumber(ARGV[10]), ARGV[11], tonumber(ARGV[12])
redis.call('SADD', models, model)
redis.call('HSET', alive, me, now + alive_ttl)
tidy()
if redis.call('ZSCORE', holds, id) then return {GRANTED, now, '', mine()} end  -- asked twice: granted already
if redis.call('ZCARD', queue) == 0 and not blocked(endpoint, est) then
  admit(id, est)
  return {GRANTED, now, '', mine()}
end
if redis.call('HEXISTS', waiters, id) == 0 and not redis.call('ZSCORE', holds, id) then
  local start = math.max(tonumber(redis.call('HGET', tags, '_v') or '0'),
                         tonumber(redis.call('HGET', tags, 's:' .. session) or '0'))
  redis.call('HSET', tags, 's:' .. session, start + 1 / weight)
  redis.call('ZADD', queue, start, id)
  redis.call('HSET', waiters, id, cjson.encode({s = session, t = est, e = endpoint}))
  prune_tags()
end
local why = grant() or ''
local granted_now = mine()
for _, g in ipairs(granted_now) do if g == id then return {GRANTED, now, why, granted_now} end end
return {LATER, now, why, granted_now}
""",
)

# ARGV after the header: the caller's waiting ids to check (a census, at most once a second; none otherwise). The
# coordinator's look: the process stays alive, queued calls are granted while capacity allows. Reply: {the
# caller's grants, those census ids neither queued nor granted (dropped while the process was silent: asked again),
# the limit that holds the queue}.
POLL: Final = lua_script(
    *_PARTS,
    f"local ALIVE_KEPT = {ALIVE_KEPT}\n",
    """
redis.call('HSET', alive, me, now + alive_ttl)
-- processes whose waiters lapsed (stopped, shut down cleanly) are forgotten: a lapsed entry and none mean the same.
-- Only once the hash has doubled since the last pruning (`_pruned`: its size then), so a large cluster does not
-- scan it at every look (amortized O(1) a look)
local size = redis.call('HLEN', alive)
if size > math.max(ALIVE_KEPT, 2 * tonumber(redis.call('HGET', alive, '_pruned') or '0')) then
  local entries, old = redis.call('HGETALL', alive), {}
  for i = 1, #entries, 2 do
    if entries[i] ~= '_pruned' and tonumber(entries[i + 1]) < now then old[#old + 1] = entries[i] end
  end
  for i = 1, #old, 500 do redis.call('HDEL', alive, unpack(old, i, math.min(i + 499, #old))) end
  redis.call('HSET', alive, '_pruned', size - #old)
end
tidy()
local why = grant() or ''
local lost = {}
for i = 8, #ARGV do
  if redis.call('HEXISTS', waiters, ARGV[i]) == 0 and not redis.call('ZSCORE', holds, ARGV[i]) then
    lost[#lost + 1] = ARGV[i]
  end
end
return {mine(), lost, why}
""",
)

# ARGV after the header: the waiter id, the call's tokens as reported (-1: keep the estimate). The call ended
# (or its fork stopped waiting): its hold and any queued entry go, its tokens are settled while it counts in the
# window, and the capacity it frees is granted at once. Reply: the caller's grants.
RELEASE: Final = lua_script(
    *_PARTS,
    """
local id, used = ARGV[8], tonumber(ARGV[9])
redis.call('ZREM', holds, id)
redis.call('ZREM', queue, id)
redis.call('HDEL', waiters, id)
local reserved = redis.call('HGET', tokens, id)
if used >= 0 and reserved then
  redis.call('HSET', tokens, id, used)
  redis.call('HINCRBY', tokens, '_sum', used - tonumber(reserved))
end
tidy()
grant()
return mine()
""",
)

# KEYS: each model's holds (one per model). ARGV: expiry from now (ms), then per model its count and hold ids. The
# process's heartbeat: one call renews every hold it has (a hold it no longer has, expired, is not brought back).
RENEW: Final = lua_script(
    NOW,
    """
local ttl, at = tonumber(ARGV[1]), 2
for k = 1, #KEYS do
  local n = tonumber(ARGV[at])
  for i = at + 1, at + n do  -- a hold past its expiry is gone even before a script removes it: not brought back
    local expiry = tonumber(redis.call('ZSCORE', KEYS[k], ARGV[i]) or '0')
    if expiry > now then redis.call('ZADD', KEYS[k], now + ttl, ARGV[i]) end
  end
  at = at + n + 1
end
return 1
""",
)

# KEYS: each model's holds, queue, waiters and granted (four per model), then the liveness hash, then the models
# set. ARGV: a dead process's presence token, then the models in KEYS' order. The sweeper, for a worker whose
# connection is gone: its holds and queued calls go at once (its forks are revived as fast), and a model with no
# call in flight or queued leaves the models set (its next call adds it again), so the set, and this script, stay
# as large as the models in use, whatever model names launches bring. Reply: the holds freed.
RELEASE_OWNER: Final = lua_script(
    """
local prefix, freed = ARGV[1] .. '|', 0
for k = 1, #KEYS - 2, 4 do
  for _, id in ipairs(redis.call('ZRANGE', KEYS[k], 0, -1)) do
    if string.sub(id, 1, #prefix) == prefix then redis.call('ZREM', KEYS[k], id); freed = freed + 1 end
  end
  for _, id in ipairs(redis.call('ZRANGE', KEYS[k + 1], 0, -1)) do
    if string.sub(id, 1, #prefix) == prefix then
      redis.call('ZREM', KEYS[k + 1], id); redis.call('HDEL', KEYS[k + 2], id)
    end
  end
  redis.call('HDEL', KEYS[k + 3], ARGV[1])
  if redis.call('EXISTS', KEYS[k], KEYS[k + 1]) == 0 then redis.call('SREM', KEYS[#KEYS], ARGV[2 + (k - 1) / 4]) end
end
redis.call('HDEL', KEYS[#KEYS - 1], ARGV[1])
return freed
""",
)

# KEYS: the model's cooldown hash. ARGV: endpoint, ms from now (0: only read). The endpoint asked for a pause:
# calls to it for this model wait until then (a later end wins; the hash lives as long as its latest cooldown).
# Reply: {until (Redis ms; 0: none), now}.
COOLDOWN: Final = lua_script(
    NOW,
    """
local until_ms = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local ms = tonumber(ARGV[2])
if ms > 0 and now + ms > until_ms then
  until_ms = now + ms
  redis.call('HSET', KEYS[1], ARGV[1], until_ms)
  if redis.call('PTTL', KEYS[1]) < ms then redis.call('PEXPIRE', KEYS[1], ms) end
end
if until_ms <= now then until_ms = 0 end
return {until_ms, now}
""",
)

# KEYS: state, events. ARGV: epoch, owner, the wait (the state's `model_wait`; '' clears it), the event's data
# ('' for none), ms waited (moves the fork's first start on, as a parked fork's time is not counted). Written only
# while the fork runs under this claim; the reply is `running`, else what the fork is now (the run learns why at
# its next fenced write).
MODEL_WAIT: Final = lua_script(
    """
local status = redis.call('HGET', KEYS[1], 'status') or MISSING
if status ~= RUNNING then return status end
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return STALE end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return LOST end
if ARGV[3] == '' then redis.call('HDEL', KEYS[1], 'model_wait')
else redis.call('HSET', KEYS[1], 'model_wait', ARGV[3]) end
if ARGV[4] ~= '' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'model_wait', 'data', ARGV[4])
end
local waited = tonumber(ARGV[5])
if waited > 0 and redis.call('HEXISTS', KEYS[1], 'first_started_ms') == 1 then
  redis.call('HINCRBY', KEYS[1], 'first_started_ms', waited)
end
return RUNNING
""",
)
