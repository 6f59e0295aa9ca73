"""The Lua scripts behind `workers.store.lease.Leases`: claims, fenced writes, renewals and the sweeper's check.

Each script is one atomic step on one fork's keys (and the shared running index). Every write a run
makes under its claim is fenced: the epoch must still be the claim's, the lease must still hold the
claim's owner token, and the fork must still be `running`; otherwise the script writes nothing.

A run retries a write whose reply it never got (Redis restarted, a connection dropped), so every
script a run calls recognises its own earlier effect and answers as if it had just written it: a
claim finds its owner token in the lease, an append finds its entries at their position, an emit
finds its mark, and finish, release and park find the claim's owner token in `released_by`. A
retried write therefore never writes twice.

A lease that lapsed while Redis was unreachable (the outage outlasted what was left of it) is taken
back by its own run, at its next renewal or fenced write, if nobody revived the fork meanwhile: the
lease key is gone, but the state still names the claim's owner token and epoch, and the fork is
still `running`. Reviving resets the owner and the status, and a new claim bumps the epoch, so a
fork that moved on is never taken back. Each take-back counts in the state's `retaken`. The tests
are those of `Leases` (tests/store/test_lease.py).
"""

from __future__ import annotations

from typing import Final

from workers.store.script_parts import NOW, lua_script


def worker_lost_error(max_attempts: int) -> str:
    """Why a fork whose worker was lost `max_attempts` times failed: its state's, result's and event's error."""
    return (
        f"worker_lost: the worker running this fork was lost {max_attempts} times (FORKQ_MAX_ATTEMPTS), so it is "
        "not run again; each run died or stopped renewing its lease: look in the worker logs for what ended it "
        "(out of memory, a killed process, a tool that hangs the process), fix that, then launch the task again"
    )


# KEYS[1] state, KEYS[2] lease: the guard every fenced write starts with. ARGV[1] epoch, ARGV[2] owner.
# The lease must hold the owner token, or have lapsed with the state still naming this claim (see the
# module docstring); `@RETAKE@` then runs, after every check passed.
_FENCE = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return STALE end
local lease = redis.call('GET', KEYS[2])
if lease ~= ARGV[2] and (lease or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2]) then return LOST end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= RUNNING then return status or MISSING end
if not lease then
  redis.call('HINCRBY', KEYS[1], 'retaken', 1)
  @RETAKE@
end
"""


def _fence(ttl_arg: str | None) -> str:
    """The fence; a write that keeps the fork running (`ttl_arg`: the ARGV holding the lease TTL in ms) sets the
    lapsed lease again, one that gives the lease up (finish, release, park) has nothing to restore."""
    retake = f"redis.call('SET', KEYS[2], ARGV[2], 'PX', {ttl_arg})" if ttl_arg else ""
    return _FENCE.replace("@RETAKE@", retake)


# Before the fence of the scripts that give the lease up (release, park): this claim's own earlier
# attempt already gave it up, and only its reply was lost. ARGV[2] owner; its reply `released`.
_ALREADY_RELEASED = """
if redis.call('HGET', KEYS[1], 'released_by') == ARGV[2] then return RELEASED end
"""

# KEYS: state, lease, events, running, bootstrap, journal, inbox. ARGV: owner, ttl_ms, fork_id, job digest ('' = any),
# surface entry ('' = none), model_call event data, the job's record bytes. One round trip: refuse a job
# whose digest is not the launch digest, claim, and hand back the bootstrap record and the journal the run
# starts from. On a first claim with an empty journal, a worker that built the first request from the job's
# record (which hashes to the job digest, checked here, and equals the stored record) also records its tool
# surface and publishes the first `model_call`: the checkpoint before the first model call, in the same
# round trip (`primed`; the record is then not sent back). The reply ends with the inbox's length (messages
# `send` left for the run to deliver). A retried claim whose first attempt ran (the
# lease holds its owner token, or lapsed since with the state still naming it) gets the same claim back
# and writes nothing but the lapsed lease.
CLAIM: Final = lua_script(
    NOW,
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {MISSING} end
if ARGV[4] ~= '' and redis.call('HGET', KEYS[1], 'digest') ~= ARGV[4] then return {FORGED} end
local record = redis.call('GET', KEYS[5]) or ''
local epoch, attempt, primed = 0, 0, 0
local surface = ARGV[5] and ARGV[5] ~= '' and ARGV[7] == record
local lease = redis.call('GET', KEYS[2])
if status == RUNNING and (lease == ARGV[1] or (not lease and redis.call('HGET', KEYS[1], 'owner') == ARGV[1])) then
  if not lease then  -- granted, then lapsed while the worker could not reach Redis: still its own
    redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
    redis.call('HINCRBY', KEYS[1], 'retaken', 1)
  end
  epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch'))
  attempt = tonumber(redis.call('HGET', KEYS[1], 'attempt'))
  if surface and attempt == 1 and redis.call('LLEN', KEYS[6]) == 1 and redis.call('LINDEX', KEYS[6], 0) == ARGV[5] then
    primed, record = 1, ''
  end
else
  if status ~= QUEUED then return {status} end
  if lease then return {LEASED} end
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
  attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
  redis.call('HSET', KEYS[1], 'status', RUNNING, 'owner', ARGV[1], 'started_ms', now)
  redis.call('HSETNX', KEYS[1], 'first_started_ms', now)
  redis.call('HDEL', KEYS[1], 'model_wait')  -- a wait for admission of a lost run is over
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[2]), ARGV[3])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'started', 'data',
             cjson.encode({owner = ARGV[1], attempt = attempt, epoch = epoch}))
  if surface and attempt == 1 and redis.call('LLEN', KEYS[6]) == 0 then
    redis.call('RPUSH', KEYS[6], ARGV[5])
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'model_call', 'data', ARGV[6])
    primed, record = 1, ''
  end
end
return {CLAIMED, attempt, epoch, record, redis.call('LRANGE', KEYS[6], 0, -1),
        redis.call('HGET', KEYS[1], 'first_started_ms'), now, primed, redis.call('LLEN', KEYS[7])}
""",
)

# KEYS: state, lease, journal, events, inbox. ARGV: epoch, owner, lease ttl_ms, seq, n entries, entries…, then
# event (type, data) pairs. Entries are appended only at the expected position; the events go with them. A
# retry that finds exactly these entries at that position (its first attempt ran) succeeds without writing.
# The reply is `mail` instead of `ok` while the inbox holds messages for the run to deliver.
APPEND: Final = lua_script(
    _fence("ARGV[3]")
    + """
local ok = OK
if redis.call('LLEN', KEYS[5]) > 0 then ok = MAIL end
local len, seq, n = redis.call('LLEN', KEYS[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if len ~= seq then
  if n == 0 or len ~= seq + n then return SEQ end
  local stored = redis.call('LRANGE', KEYS[3], seq, seq + n - 1)
  for i = 1, n do if stored[i] ~= ARGV[5 + i] then return SEQ end end
  return ok
end
for i = 6, 5 + n do redis.call('RPUSH', KEYS[3], ARGV[i]) end
for i = 6 + n, #ARGV, 2 do
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', @MAXLEN@, '*', 'type', ARGV[i], 'data', ARGV[i + 1])
end
return ok
"""
)

# KEYS: state, lease, journal, events, inbox. ARGV: epoch, owner, lease ttl_ms, seq, n, k, n journal entries,
# the k inbox items they deliver (the last k entries are their `message` entries), then event (type, data)
# pairs. Appends the entries at the expected position and takes the oldest k messages from the inbox,
# atomically: a message is delivered once, and a retry that finds its entries written (its first attempt
# ran) succeeds without writing. The reply is `mail` while more messages wait; `inbox` if the inbox no
# longer starts with those items (nothing written).
DELIVER: Final = lua_script(
    _fence("ARGV[3]")
    + """
local len, seq, n, k = redis.call('LLEN', KEYS[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local function rest() if redis.call('LLEN', KEYS[5]) > 0 then return MAIL end return OK end
if len ~= seq then
  if len ~= seq + n then return SEQ end
  local stored = redis.call('LRANGE', KEYS[3], seq, seq + n - 1)
  for i = 1, n do if stored[i] ~= ARGV[6 + i] then return SEQ end end
  return rest()
end
if k > 0 then
  local waiting = redis.call('LRANGE', KEYS[5], 0, k - 1)
  if #waiting ~= k then return INBOX end
  for i = 1, k do if waiting[i] ~= ARGV[6 + n + i] then return INBOX end end
end
for i = 7, 6 + n do redis.call('RPUSH', KEYS[3], ARGV[i]) end
if k > 0 then redis.call('LTRIM', KEYS[5], k, -1) end
for i = 7 + n + k, #ARGV, 2 do
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', @MAXLEN@, '*', 'type', ARGV[i], 'data', ARGV[i + 1])
end
return rest()
"""
)

# KEYS: state, lease, events. ARGV: epoch, owner, mark, lease ttl_ms, then event (type, data) pairs. Fenced
# like every write (a lapsed lease still its own is taken back): `running` when the events were published
# (or had been, by a first attempt with this mark); otherwise nothing is published and the reply says why:
# the fork's status when it no longer runs (`cancelled`, `succeeded`, ...), else `stale` (another epoch) or
# `lost` (another owner).
EMIT: Final = lua_script(
    """
local status = redis.call('HGET', KEYS[1], 'status') or MISSING
if status ~= RUNNING then return status end
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return STALE end
local lease = redis.call('GET', KEYS[2])
if lease ~= ARGV[2] then
  if lease or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return LOST end
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[4])
  redis.call('HINCRBY', KEYS[1], 'retaken', 1)
end
if #ARGV > 4 and redis.call('HGET', KEYS[1], 'emitted') ~= ARGV[3] then
  for i = 5, #ARGV, 2 do
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', ARGV[i], 'data', ARGV[i + 1])
  end
  redis.call('HSET', KEYS[1], 'emitted', ARGV[3])
end
return RUNNING
"""
)

# KEYS: state, lease, events, running, result, journal, bootstrap, inbox. ARGV: epoch, owner, status,
# result bytes, error, event data, ttl_s, fork_id, seq, n entries, entries…, then event (type, data)
# pairs. The last journal entries and events go with the result (at the expected position only).
# A fork that would succeed while its inbox holds messages (sent during its last model call) is not
# finished: its entries are written, and it goes back to `queued` like a released fork (indexed until its
# job is confirmed enqueued, due after 30 s), so its next run delivers them: the reply is then `continued`.
FINISH: Final = lua_script(
    NOW,
    """
-- this claim's own earlier attempt wrote this very result (or continued the fork), and only its reply was lost
if redis.call('HGET', KEYS[1], 'released_by') == ARGV[2] then
  if redis.call('GET', KEYS[5]) == ARGV[4] then return FINISHED end
  if redis.call('HGET', KEYS[1], 'status') == QUEUED then return CONTINUED end
end
"""
    + _fence(None)
    + """
local n = tonumber(ARGV[10])
if n > 0 and redis.call('LLEN', KEYS[6]) ~= tonumber(ARGV[9]) then return SEQ end
for i = 11, 10 + n do redis.call('RPUSH', KEYS[6], ARGV[i]) end
for i = 11 + n, #ARGV, 2 do
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', ARGV[i], 'data', ARGV[i + 1])
end
if ARGV[3] == SUCCEEDED and redis.call('LLEN', KEYS[8]) > 0 then
  redis.call('HSET', KEYS[1], 'status', QUEUED, 'owner', '', 'released_by', ARGV[2])
  redis.call('HDEL', KEYS[1], 'first_started_ms')  -- the next exchange's wall clock starts at its claim
  redis.call('DEL', KEYS[2])
  redis.call('ZADD', KEYS[4], now + 30000, ARGV[8])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'released', 'data',
             cjson.encode({reason = 'messages arrived as it answered: the next run delivers them'}))
  return CONTINUED
end
redis.call('SET', KEYS[5], ARGV[4], 'EX', ARGV[7])
redis.call('HSET', KEYS[1], 'status', ARGV[3], 'finished_ms', now, 'error', ARGV[5], 'released_by', ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[4], ARGV[8])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'finished', 'data', ARGV[6])
for _, i in ipairs({1, 3, 6, 7, 8}) do redis.call('EXPIRE', KEYS[i], ARGV[7]) end
return FINISHED
""",
)

# KEYS: state, lease, events, running. ARGV: epoch, owner, fork_id, reason, grace_ms. Back to queued.
RELEASE: Final = lua_script(
    NOW,
    _ALREADY_RELEASED
    + _fence(None)
    + """
redis.call('HSET', KEYS[1], 'status', QUEUED, 'owner', '', 'released_by', ARGV[2])
redis.call('DEL', KEYS[2])
-- stays indexed, due after ARGV[5] ms, until its job is confirmed enqueued (`enqueued`): a failed
-- publish is then re-enqueued by a sweeper
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'released', 'data',
           cjson.encode({reason = ARGV[4]}))
return RELEASED
""",
)

# KEYS: state, lease, events, running, and for a pause by its session's budget that session's set of budget-paused
# forks. ARGV: epoch, owner, fork_id, reason, status (paused or awaiting_approval), pending calls (JSON), event
# data, and the pause's detail ('' or absent: none). Parked, holding no worker and out of the
# running index (never revived), until an operator resumes it or a person decides its calls. The reason
# a paused fork waits goes to the state's `waiting` field (a parked one waits on its `pending` calls), never
# to its `error`; a budget pause's human account to `waiting_detail`. The set gets the fork with its pause, so a
# raise of the budget that reads the set after the pause resumes it (the runner checks the budget after it).
PAUSE: Final = lua_script(
    NOW,
    _ALREADY_RELEASED
    + _fence(None)
    + """
redis.call('HSET', KEYS[1], 'status', ARGV[5], 'owner', '', 'error', '', 'waiting', ARGV[4], 'pending', ARGV[6],
           'parked_ms', now, 'released_by', ARGV[2])
if ARGV[8] and ARGV[8] ~= '' then
  redis.call('HSET', KEYS[1], 'waiting_detail', ARGV[8])
else
  redis.call('HDEL', KEYS[1], 'waiting_detail')
end
if KEYS[5] then
  redis.call('SADD', KEYS[5], ARGV[3])
  local ttl, left = redis.call('TTL', KEYS[1]), redis.call('TTL', KEYS[5])
  if ttl > 0 and (left < 0 or left < ttl) then redis.call('EXPIRE', KEYS[5], ttl) end  -- not GT/NX: Redis 6.2
end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[4], ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', ARGV[5], 'data', ARGV[7])
return RELEASED
""",
)

# KEYS: running, then each fork's lease and state. ARGV: ttl_ms, then each fork's owner, fork_id, epoch.
# Per fork, 1: renewed; 2: the lease had lapsed and is taken back (the fork still runs under this claim:
# nobody revived it); 0: not ours any more. A fork that stopped running (cancelled) is not renewed: its
# worker learns at the next beat and stops its tool (cooperative cancellation). One call renews many forks
# (the heartbeat sends `RENEW_BATCH` of them per call, all calls in one round trip), so a beat's cost in
# the worker is a few commands whatever the number of forks.
RENEW: Final = lua_script(
    NOW,
    """
local ttl = tonumber(ARGV[1])
local out = {}
for i = 1, (#KEYS - 1) / 2 do
  local lease_key, state_key = KEYS[2 * i], KEYS[2 * i + 1]
  local owner, fork_id, epoch = ARGV[3 * i - 1], ARGV[3 * i], ARGV[3 * i + 1]
  local lease = redis.call('GET', lease_key)
  local renewed = 1
  if lease ~= owner then
    if lease or redis.call('HGET', state_key, 'owner') ~= owner then renewed = 0
    elseif redis.call('HGET', state_key, 'epoch') ~= epoch then renewed = 0 end
  end
  if renewed == 1 and redis.call('HGET', state_key, 'status') ~= RUNNING then renewed = 0 end
  if renewed == 1 then
    redis.call('SET', lease_key, owner, 'PX', ttl)
    redis.call('ZADD', KEYS[1], now + ttl, fork_id)
    if not lease then redis.call('HINCRBY', state_key, 'retaken', 1); renewed = 2 end
  end
  out[i] = renewed
end
return out
""",
)

# KEYS: the sweepers' clock. ARGV: gap_ms, grace_ms, clock ttl_ms. One call per sweeper pass: records the pass
# and returns 1 while lapsed leases are left to their workers. No pass reached Redis for more than `gap_ms`
# (a Redis outage, or no sweeper running): the grace starts now, for `grace_ms`. No pass for a day or ever
# (the clock expired): nothing to tell, no grace. Otherwise (sweepers ran all
# along) a lapsed lease means a dead or silent worker, revived at once.
SWEEP_CLOCK: Final = lua_script(
    NOW,
    """
local last = tonumber(redis.call('HGET', KEYS[1], 'last') or '0')
local grace_until = tonumber(redis.call('HGET', KEYS[1], 'grace_until') or '0')
if last > 0 and now - last > tonumber(ARGV[1]) then
  grace_until = now + tonumber(ARGV[2])
  redis.call('HSET', KEYS[1], 'grace_until', grace_until)
end
redis.call('HSET', KEYS[1], 'last', now)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if grace_until > now then return 1 end
return 0
""",
)

# KEYS: state, lease, events, running, result. ARGV: fork_id, max_attempts, failed result bytes, ttl_s,
# grace_ms, lapse_grace_ms, the failure's reason (`worker_lost_error`: the state, the result and the
# event carry the same text). A revived fork stays in the running index, `grace_ms` ahead, until its job is
# enqueued (`ENQUEUED`): if the sweeper dies or the broker is down in between, a later sweep enqueues it.
# A lease that lapsed less than `lapse_grace_ms` ago (its index score is its end) is left to its worker
# (`grace`): after a Redis outage the worker takes it back at its first renewal. ARGV[8], when given, is
# the owner token of a worker whose connection is gone (`workers.store.presence`): a lease it still holds
# is ended at once, without waiting for its TTL.
REVIVE: Final = lua_script(
    NOW,
    """
local status = redis.call('HGET', KEYS[1], 'status')
if status == QUEUED then
  -- revived earlier: enqueue again only if its job was never confirmed and its grace has passed
  local due = redis.call('ZSCORE', KEYS[4], ARGV[1])
  if not due or tonumber(due) > now then return QUEUED end
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), ARGV[1])
  return REQUEUE
end
if status ~= RUNNING then redis.call('ZREM', KEYS[4], ARGV[1]); return status or MISSING end
local left = redis.call('PTTL', KEYS[2])
local dead = ARGV[8] ~= nil and ARGV[8] ~= '' and redis.call('GET', KEYS[2]) == ARGV[8]
if dead then
  redis.call('DEL', KEYS[2])  -- its worker's connection is gone: the lease holder is dead
elseif left > 0 then redis.call('ZADD', KEYS[4], now + left, ARGV[1]); return ALIVE end
local grace = tonumber(ARGV[6] or '0')
local ended = tonumber(redis.call('ZSCORE', KEYS[4], ARGV[1]) or '0')
if not dead and grace > 0 and ended + grace > now then return GRACE end
local lost = redis.call('HINCRBY', KEYS[1], 'lost', 1)
if lost >= tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[4], ARGV[1])
  local reason = ARGV[7]
  redis.call('HSET', KEYS[1], 'status', FAILED, 'finished_ms', now, 'error', reason, 'owner', '')
  redis.call('SET', KEYS[5], ARGV[3], 'EX', ARGV[4])
  for _, i in ipairs({1, 3}) do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'finished', 'data',
             cjson.encode({status = FAILED, error = reason}))
  return FAILED
end
redis.call('HSET', KEYS[1], 'status', QUEUED, 'owner', '')
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), ARGV[1])
local attempt = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0')
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'revived', 'data',
           cjson.encode({attempt = attempt, lost = lost, via = dead and 'connection' or 'lease'}))
return REVIVE
""",
)

# KEYS: state, running. ARGV: fork_id. The revived fork's job is in the broker: drop it from the index.
ENQUEUED: Final = lua_script(
    """
if redis.call('HGET', KEYS[1], 'status') == QUEUED then redis.call('ZREM', KEYS[2], ARGV[1]) end
return 1
"""
)
