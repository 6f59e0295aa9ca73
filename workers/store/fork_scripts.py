"""The Lua scripts of `workers.store.forks`: a fork's launch, its cancel, a person's decision, a resume, a message.

Each runs atomically over keys that share the fork's hash tag (the session's index and names are the keys
outside it); every word one returns or writes is a constant of the enums (`workers.store.script_parts`).
"""

from __future__ import annotations

from workers.store.script_parts import NOW, lua_script

# KEYS: bootstrap, state, events, the parent session's forks, the session's tombstone, and with a job: the broker
# queue's list, then the chunk keys the caller did not send again. ARGV: record bytes, ttl_s, kind, description,
# digest, event data, fork id, tenant ('' for `default`), and with a job: the queue item, the task-sent event's
# channel ('' for none) and message. Returns the outcome and whether the job was queued; a launch into a cancelled
# session (its tombstone exists) writes nothing and returns `session_cancelled` and the tombstone (the Redis ms until
# which it refuses), so a launch racing a session cancel either lands before it (and is cancelled by it) or is
# refused. A launch found written already (a retried launch) is not refused: it landed before. The session index gets
# the fork with its record (the session's keys are the ones outside the fork's hash tag). The job goes onto the queue
# after the record (the order a worker needs), and only if every chunk it names is there: a chunk gone since the
# caller wrote it is written again first, and the job then sent by the caller.
# A new stream's first node is allocated at 4 KiB (Redis 7's XADD pre-allocates `stream-node-max-bytes`, at most
# 4096), most of a queued fork's memory: written anew by DUMP and RESTORE, the stream keeps only what its `queued`
# event needs (about 0.8 KB), and grows from there as the worker appends. Best effort: where a server renames or
# refuses DUMP or RESTORE (some managed services do), the stream stays as XADD made it.
LAUNCH = lua_script(
    NOW,
    """
local function send(outcome)
  if ARGV[9] == nil or ARGV[9] == '' then return {outcome, 0} end
  for i = 7, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 0 then return {outcome, 0} end
  end
  redis.call('LPUSH', KEYS[6], ARGV[9])
  if ARGV[10] ~= '' then redis.call('PUBLISH', ARGV[10], ARGV[11]) end
  return {outcome, 1}
end
local existing = redis.call('GET', KEYS[1])
if existing and existing ~= ARGV[1] then return {CONFLICT, 0} end
if redis.call('EXISTS', KEYS[2]) == 1 then return send(EXISTS) end
local tombstone = redis.call('GET', KEYS[5])
if tombstone then return {SESSION_CANCELLED, tombstone} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('HSET', KEYS[2], 'status', QUEUED, 'kind', ARGV[3], 'description', ARGV[4], 'digest', ARGV[5],
           'attempt', 0, 'created_ms', now)
if ARGV[8] ~= '' then redis.call('HSET', KEYS[2], 'tenant', ARGV[8]) end
redis.call('EXPIRE', KEYS[2], ARGV[2])
local fresh = redis.call('EXISTS', KEYS[3]) == 0
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'queued', 'data', ARGV[6])
local restored = false
if fresh then
  local dumped = redis.pcall('DUMP', KEYS[3])
  if type(dumped) == 'string' then
    local reply = redis.pcall('RESTORE', KEYS[3], tonumber(ARGV[2]) * 1000, dumped, 'REPLACE')
    restored = type(reply) == 'table' and reply.ok ~= nil
  end
end
if not restored then redis.call('EXPIRE', KEYS[3], ARGV[2]) end
redis.call('ZADD', KEYS[4], now, ARGV[7])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[2]) * 1000)
redis.call('EXPIRE', KEYS[4], ARGV[2])
return send(CREATED)
""",
)

# KEYS: the parent session's tombstone, then chunks of that parent (one hash tag). ARGV: ttl_s, then each chunk's
# bytes, or '' for a chunk the client wrote before (not sent again). Returns the 1-based positions of the '' chunks
# that are gone. Into a cancelled session (its tombstone exists) it writes nothing: the launch script that follows
# refuses the launch.
PUT_CHUNKS = lua_script(
    """
if redis.call('EXISTS', KEYS[1]) == 1 then return {} end
local gone = {}
for i = 2, #KEYS do
  if ARGV[i] ~= '' then redis.call('SET', KEYS[i], ARGV[i], 'NX', 'EX', ARGV[1]) end
  -- a chunk lives at least as long as the newest record naming it
  if redis.call('EXPIRE', KEYS[i], ARGV[1]) == 0 then table.insert(gone, i - 1) end
end
return gone
"""
)

# KEYS: state, events, result, bootstrap, journal. ARGV: fork_id, ttl_s, n, and the usage of the first n journal
# entries (input tokens, output tokens, model calls, tool uses, cached input tokens). Terminal forks stay. The
# entries appended since the caller read those n are counted here (so the usage is exact however the fork raced
# the cancel), and the duration runs from the first start to now, or to when the fork parked. The result is
# msgpack (cmsgpack's, which ForkResult.decode reads); the finished event carries the same usage.
CANCEL = lua_script(
    NOW,
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return MISSING end
if status == SUCCEEDED or status == FAILED or status == CANCELLED then return status end
local usage = {input_tokens = tonumber(ARGV[4]), output_tokens = tonumber(ARGV[5]), model_calls = tonumber(ARGV[6]),
               tool_uses = tonumber(ARGV[7]), cached_input_tokens = tonumber(ARGV[8]), duration_ms = 0}
for _, raw in ipairs(redis.call('LRANGE', KEYS[5], tonumber(ARGV[3]), -1)) do
  local ok, entry = pcall(cmsgpack.unpack, raw)
  if ok and type(entry) == 'table' and entry.kind == 'model' then
    usage.model_calls = usage.model_calls + 1
    usage.input_tokens = usage.input_tokens + (tonumber(entry.input_tokens) or 0)
    usage.output_tokens = usage.output_tokens + (tonumber(entry.output_tokens) or 0)
    usage.cached_input_tokens = usage.cached_input_tokens + (tonumber(entry.cached_input_tokens) or 0)
  elseif ok and type(entry) == 'table' and entry.kind == 'tool_result' then
    usage.tool_uses = usage.tool_uses + 1
  end
end
usage.total_tokens = usage.input_tokens + usage.output_tokens
local first = tonumber(redis.call('HGET', KEYS[1], 'first_started_ms') or '')
if first then
  local parked = tonumber(redis.call('HGET', KEYS[1], 'parked_ms') or '')
  usage.duration_ms = math.max(0, (parked or now) - first)
end
local err = 'cancelled by request'
redis.call('HSET', KEYS[1], 'status', CANCELLED, 'finished_ms', now, 'error', err)
local result = {schema_version = 1, fork_id = ARGV[1], status = CANCELLED, error = err, usage = usage}
redis.call('SET', KEYS[3], cmsgpack.pack(result), 'EX', ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'finished', 'data',
           cjson.encode({status = CANCELLED, error = err, usage = usage}))
for _, i in ipairs({1, 2, 4, 5}) do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
return CANCELLED
""",
)


# Time spent parked (paused, awaiting approval) does not count against the wall-clock limit: the
# fork's first start moves forward by it when the fork is queued again, and it waits no more.
UNPARK = """
local parked = tonumber(redis.call('HGET', KEYS[1], 'parked_ms') or '')
local first = tonumber(redis.call('HGET', KEYS[1], 'first_started_ms') or '')
if parked and first then redis.call('HSET', KEYS[1], 'first_started_ms', first + (now - parked)) end
redis.call('HDEL', KEYS[1], 'parked_ms', 'waiting', 'waiting_detail')
"""

# KEYS: state, events. A paused fork goes back to queued (the caller re-enqueues it).
RESUME = lua_script(
    NOW,
    """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= PAUSED then return status or MISSING end
"""
    + UNPARK
    + """
redis.call('HSET', KEYS[1], 'status', QUEUED, 'error', '')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'resumed', 'data', '{}')
return RESUMED
""",
)


# KEYS: state, journal, events, running. ARGV: call id, approval entry bytes, its seq, event type, event
# data, grace_ms, fork_id. Records a person's decision on one parked call; the last one puts the fork
# back in the queue state (indexed, due after grace_ms, until its job is confirmed enqueued).
DECIDE = lua_script(
    NOW,
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return MISSING end
if status ~= AWAITING_APPROVAL then return status end
local pending = cjson.decode(redis.call('HGET', KEYS[1], 'pending') or '[]')
local left, found = {}, false
for _, p in ipairs(pending) do
  if p.call_id == ARGV[1] then found = true else table.insert(left, p) end
end
if not found then return UNKNOWN_CALL end
if redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[3]) then return SEQ end
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', ARGV[4], 'data', ARGV[5])
if #left > 0 then
  redis.call('HSET', KEYS[1], 'pending', cjson.encode(left))
  return RECORDED
end
redis.call('HSET', KEYS[1], 'status', QUEUED, 'pending', '', 'error', '')
"""
    + UNPARK
    + """
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[6]), ARGV[7])
return QUEUED
""",
)


# KEYS: the session's names hash, its tombstone. ARGV: name, the fork id it must map to now ('' = none), the new
# fork id, ttl_s. Compare-and-set: 1 when the name now maps to the new fork, 0 when another launch got there first;
# in a cancelled session, nothing is written and the answer is its tombstone (a string: until when it refuses).
CLAIM_NAME = lua_script(
    """
local tombstone = redis.call('GET', KEYS[2])
if tombstone then return tombstone end
if (redis.call('HGET', KEYS[1], ARGV[1]) or '') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""
)

# KEYS: state, inbox, events, running, result, and the tombstone of the fork's session when its record names one.
# ARGV: message, inbox limit, ttl_s, fork_id, grace_ms. A message for the fork: refused (the status) when it has
# failed or was cancelled, `full` when its inbox is; otherwise queued in the inbox. A succeeded fork is continued:
# back to `queued` for its next exchange (its result gone until that ends, its wall clock and attempts counted
# afresh), indexed until its job is confirmed enqueued; but not while its session's tombstone exists (a session
# cancel): then nothing is written, and the answer is `session_cancelled` and the tombstone.
SEND = lua_script(
    NOW,
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {MISSING, 0} end
if status == FAILED or status == CANCELLED then return {status, 0} end
if status == SUCCEEDED and KEYS[6] then
  local tombstone = redis.call('GET', KEYS[6])
  if tombstone then return {SESSION_CANCELLED, tombstone} end
end
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[2]) then return {FULL, redis.call('LLEN', KEYS[2])} end
local waiting = redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[3])
if status ~= SUCCEEDED then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'message', 'data',
             cjson.encode({waiting = waiting, status = status}))
  return {QUEUED, waiting}
end
redis.call('HSET', KEYS[1], 'status', QUEUED, 'owner', '', 'error', '', 'attempt', 0)
redis.call('HDEL', KEYS[1], 'first_started_ms', 'finished_ms', 'parked_ms')
redis.call('DEL', KEYS[5])
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), ARGV[4])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'message', 'data',
           cjson.encode({waiting = waiting, status = status, continued = true}))
return {CONTINUED, waiting}
""",
)


# KEYS: the session's tombstone, the session's forks. ARGV: tombstone_s. The first step of a session cancel: the
# tombstone, until now + tombstone_s (or a later one a cancel already wrote), before the session's forks are read;
# from then on no launch adds to the session (the launch script refuses it), so the forks read after it are all
# there will be. Returns the tombstone (Redis ms) and how many forks the session's index holds.
TOMBSTONE = lua_script(
    NOW,
    """
local until_ms = now + tonumber(ARGV[1]) * 1000
local current = tonumber(redis.call('GET', KEYS[1]) or '')
if current and current > until_ms then until_ms = current end
redis.call('SET', KEYS[1], string.format('%d', until_ms), 'PX', string.format('%d', until_ms - now))
return {until_ms, redis.call('ZCARD', KEYS[2])}
""",
)
