"""Lua scripts: every state change that must be atomic with an XACK happens in one of these.

The fence. An entry of a stream belongs to the consumer that the consumer group's pending list
(PEL) says holds it, and each (re)delivery bumps the PEL's delivery counter. A worker remembers
the counter it was handed (its *fence*) and every write checks both the owner and the counter,
so a worker that lost its entry to ``XAUTOCLAIM`` (or an older coroutine of the same worker)
can never write a session, a trajectory or a score for it. Because result and ack are written
together, a redelivered entry cannot produce a second result either.

Every script takes many items, so a worker pays one round trip per batch, not per episode.
"""

from __future__ import annotations

_OWNS = """
local function owns(stream, group, id, consumer, fence)
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if #p == 0 then return false end
  return p[1][2] == consumer and tonumber(p[1][4]) == tonumber(fence)
end
"""

# KEYS[1]=stream. ARGV: group, consumer, min_idle_ms, count, cursor, mode ('stale'|'own'),
# session_prefix ('' for none). Returns {next_cursor, {{id, task_id, payload, deliveries,
# session|false}, ...}, {deleted ids}}.
CLAIM = """
local stream = KEYS[1]
local group, consumer = ARGV[1], ARGV[2]
local min_idle, count, cursor, mode, sprefix =
  tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], ARGV[6], ARGV[7]
local entries, nextc, deleted = {}, '0-0', {}
if mode == 'own' then
  local pend = redis.call('XPENDING', stream, group, '-', '+', count, consumer)
  local ids = {}
  for _, p in ipairs(pend) do ids[#ids + 1] = p[1] end
  if #ids > 0 then entries = redis.call('XCLAIM', stream, group, consumer, 0, unpack(ids)) end
else
  local r = redis.call('XAUTOCLAIM', stream, group, consumer, min_idle, cursor, 'COUNT', count)
  nextc, entries, deleted = r[1], r[2], r[3] or {}
end
local out = {}
for _, e in ipairs(entries) do
  local id, f = e[1], e[2]
  if f then
    local tid, payload = '', ''
    for j = 1, #f, 2 do
      if f[j] == 'id' then tid = f[j + 1] elseif f[j] == 'p' then payload = f[j + 1] end
    end
    local p = redis.call('XPENDING', stream, group, id, id, 1)
    local n = 0
    if #p > 0 then n = p[1][4] end
    local sess = false
    if sprefix ~= '' then sess = redis.call('GET', sprefix .. tid) end
    out[#out + 1] = {id, tid, payload, n, sess}
  end
end
return {nextc, out, deleted}
"""

# KEYS[1]=stream. ARGV: group, consumer, then pairs (id, fence). Re-touches owned entries so
# they do not look idle; returns the ids this consumer no longer owns.
HEARTBEAT = (
    _OWNS
    + """
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local lost = {}
for i = 3, #ARGV, 2 do
  if owns(stream, group, ARGV[i], consumer, ARGV[i + 1]) then
    redis.call('XCLAIM', stream, group, consumer, 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""
)

# KEYS[1]=tasks, KEYS[2..]=session keys. ARGV: group, consumer, ttl, then (id, fence, blob).
COMMIT = (
    _OWNS
    + """
local stream, group, consumer, ttl = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local out = {}
for i = 1, #KEYS - 1 do
  local a = 4 + (i - 1) * 3
  if owns(stream, group, ARGV[a], consumer, ARGV[a + 1]) then
    redis.call('SET', KEYS[i + 1], ARGV[a + 2], 'EX', ttl)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
)

# KEYS: tasks, rollouts, stats, then session keys. ARGV: group, consumer, then
# (id, fence, task_id, trajectory blob). Writes the trajectory and acks the task in one step.
FINISH = (
    _OWNS
    + """
local tasks, rollouts, stats = KEYS[1], KEYS[2], KEYS[3]
local group, consumer = ARGV[1], ARGV[2]
local out, n = {}, 0
for i = 1, #KEYS - 3 do
  local a = 3 + (i - 1) * 4
  local id = ARGV[a]
  if owns(tasks, group, id, consumer, ARGV[a + 1]) then
    redis.call('XADD', rollouts, '*', 'id', ARGV[a + 2], 'p', ARGV[a + 3])
    redis.call('XACK', tasks, group, id)
    redis.call('DEL', KEYS[i + 3])
    out[i] = 1
    n = n + 1
  else
    out[i] = 0
  end
end
if n > 0 then redis.call('HINCRBY', stats, 'trajectories', n) end
return out
"""
)

# KEYS: rollouts, scored, groups, stats, then group keys. ARGV: group, consumer, schema
# version, done ttl, then (id, fence, task_id, prompt_id, k, group_size, reward, score blob,
# sample blob). Returns per item 1 (added), 2 (duplicate or group already closed; acked), 0 (not
# owned), 3 (impossible: k outside [0, group_size), a reward that is not a finite number, or a
# group_size other than the group's first sample's; not acked, the caller dead-letters it).
# When the last sample of a group arrives, the Group is written to `groups` once:
# a msgpack array [v, prompt_id, group_size, mean, std, [samples...]] built from the samples'
# own bytes.
SCORE = (
    _OWNS
    + """
local rollouts, scored, groups, stats = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, consumer, version, done_ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local function arrhdr(n)
  if n < 16 then return string.char(0x90 + n) end
  return string.char(0xdc, math.floor(n / 256), n % 256)
end
-- an entry that could never complete its group, or would index a slot the group does not
-- have, is refused (3) and left for the worker to dead-letter; one bad item must not make the
-- script fail for the whole batch
local function valid(k, size, reward, have)
  if not (k and size and reward) then return false end
  if size < 1 or size > 65535 or size ~= math.floor(size) then return false end
  if k < 0 or k >= size or k ~= math.floor(k) then
    return false
  end
  if reward ~= reward or reward == math.huge or reward == -math.huge then return false end
  return not have or tonumber(have) == size
end
local out, added, dup, done = {}, 0, 0, 0
for i = 1, #KEYS - 4 do
  local a = 5 + (i - 1) * 9
  local id, fence, tid, pid = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local k, size, reward = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local gk = KEYS[4 + i]
  if not owns(rollouts, group, id, consumer, fence) then
    out[i] = 0
  elseif not valid(k, size, reward, redis.call('HGET', gk, 'size')) then
    out[i] = 3
  else
    redis.call('XACK', rollouts, group, id)
    if redis.call('HGET', gk, 'state') then
      out[i] = 2; dup = dup + 1
    elseif redis.call('HSETNX', gk, 's' .. k, ARGV[a + 8]) == 0 then
      out[i] = 2; dup = dup + 1
    else
      redis.call('XADD', scored, '*', 'id', tid, 'p', ARGV[a + 7])
      redis.call('HSET', gk, 'r' .. k, ARGV[a + 6], 'size', ARGV[a + 5])
      out[i] = 1; added = added + 1
      if redis.call('HINCRBY', gk, 'n', 1) == size then
        local sf, rf = {}, {}
        for j = 0, size - 1 do sf[#sf + 1] = 's' .. j; rf[#rf + 1] = 'r' .. j end
        local samples = redis.call('HMGET', gk, unpack(sf))
        local rewards = redis.call('HMGET', gk, unpack(rf))
        local sum, sq = 0, 0
        for j = 1, size do sum = sum + tonumber(rewards[j]) end
        local mean = sum / size
        for j = 1, size do sq = sq + (tonumber(rewards[j]) - mean) ^ 2 end
        local std = math.sqrt(sq / size)
        local head = string.char(0x96) .. cmsgpack.pack(version, pid, size, mean + 0.0, std + 0.0)
        local body = head .. arrhdr(size) .. table.concat(samples)
        redis.call('XADD', groups, '*', 'id', pid, 'p', body)
        redis.call('DEL', gk)
        redis.call('HSET', gk, 'state', 'done')
        redis.call('EXPIRE', gk, done_ttl)
        done = done + 1
      end
    end
  end
end
if added > 0 then redis.call('HINCRBY', stats, 'scored', added) end
if dup > 0 then redis.call('HINCRBY', stats, 'duplicates_ignored', dup) end
if done > 0 then redis.call('HINCRBY', stats, 'groups_completed', done) end
return out
"""
)

# KEYS: stream, dead, scored, stats, then per item two keys (session key or '' placeholder
# key, group key). ARGV: group, consumer, done ttl, then (id, fence, task_id, dead-letter blob,
# failure-score blob or ''). Moves owned entries to the dead-letter stream, acks them, drops
# their session, and closes their group as dropped: a group with a failed sample is never
# trained on. Returns per item 1 (dead-lettered) or 0 (not owned).
DEADLETTER = (
    _OWNS
    + """
local stream, dead, scored, stats = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, consumer, done_ttl = ARGV[1], ARGV[2], ARGV[3]
local out, n, dropped = {}, 0, 0
for i = 1, (#KEYS - 4) / 2 do
  local a = 4 + (i - 1) * 5
  local id, fence, tid = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local sk, gk = KEYS[4 + (i - 1) * 2 + 1], KEYS[4 + (i - 1) * 2 + 2]
  if owns(stream, group, id, consumer, fence) then
    redis.call('XADD', dead, '*', 'id', tid, 'p', ARGV[a + 3])
    if ARGV[a + 4] ~= '' then redis.call('XADD', scored, '*', 'id', tid, 'p', ARGV[a + 4]) end
    redis.call('XACK', stream, group, id)
    redis.call('DEL', sk)
    if not redis.call('HGET', gk, 'state') then
      redis.call('DEL', gk)
      redis.call('HSET', gk, 'state', 'dropped')
      redis.call('EXPIRE', gk, done_ttl)
      dropped = dropped + 1
    end
    out[i] = 1; n = n + 1
  else
    out[i] = 0
  end
end
if n > 0 then redis.call('HINCRBY', stats, 'dead_letters', n) end
if dropped > 0 then redis.call('HINCRBY', stats, 'groups_dropped', dropped) end
return out
"""
)

# KEYS: tasks, position key. ARGV: expected position, new position, then (task_id, blob).
# Compare-and-set on the producer's position makes a re-sent batch (client retry, restarted
# producer) a no-op instead of a duplicate. Returns the number added, or -1 on a stale position.
PRODUCE = """
local cur = redis.call('GET', KEYS[2]) or '0'
if cur ~= ARGV[1] then return -1 end
local n = 0
for i = 3, #ARGV, 2 do
  redis.call('XADD', KEYS[1], '*', 'id', ARGV[i], 'p', ARGV[i + 1])
  n = n + 1
end
redis.call('SET', KEYS[2], ARGV[2])
return n
"""

# KEYS[1]=stream. ARGV: retention_ms, now_ms. Trims entries older than both the retention
# window and everything any consumer group still needs (undelivered or pending). A stream
# without consumer groups is trimmed by the retention window alone. Returns entries removed.
TRIM = """
local stream = KEYS[1]
if redis.call('EXISTS', stream) == 0 then return 0 end
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function less(a, b)
  local am, as = parse(a); local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end
local floor = string.format('%d-0', tonumber(ARGV[2]) - tonumber(ARGV[1]))
local groups = redis.call('XINFO', 'GROUPS', stream)
for _, g in ipairs(groups) do
  local name, last
  for j = 1, #g, 2 do
    if g[j] == 'name' then name = g[j + 1] end
    if g[j] == 'last-delivered-id' then last = g[j + 1] end
  end
  -- entries after last-delivered-id are undelivered: keep them (and the last one itself)
  if less(last, floor) then floor = last end
  local pend = redis.call('XPENDING', stream, name)
  if pend[1] > 0 and less(pend[2], floor) then floor = pend[2] end
end
return redis.call('XTRIM', stream, 'MINID', floor)
"""

# The call pool of an outside service (a judge endpoint) shared by every process of a run.
# Invariant: at most ARGV[3] calls hold a lease in KEYS[1] at once, and at most ceil(rate)
# calls started in any window of ceil(rate) / rate seconds (rate = ARGV[4]; 0: no rate limit).
# A lease ends by itself ARGV[2] ms after it was taken, so a killed holder's slot frees itself.
# Redis's clock, not the callers': every process reads the same one. While KEYS[3] exists the
# service asked the whole run to back off (a 429 or 503 with Retry-After, ``POOL_HOLD``): no
# call starts until it ends.
# KEYS[1]=busy zset (member: call id, score: lease end, ms), KEYS[2]=starts zset (score: start
# ms), KEYS[3]=hold (a string with a TTL). ARGV: call id, lease_ms, max_in_flight,
# max_per_second. Returns 0 when the call may start (its lease taken), minus the ms left of the
# hold while the service is held off, else about how many ms until it may ask again.
POOL_ACQUIRE = """
local held = redis.call('PTTL', KEYS[3])
if held > 0 then
  return -held
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, limit, rate = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= limit then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return math.max(1, tonumber(first[2]) - now)
end
if rate > 0 then
  local n = math.ceil(rate)
  local window = math.floor(1000 * n / rate)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
  if redis.call('ZCARD', KEYS[2]) >= n then
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    return math.max(1, tonumber(oldest[2]) + window - now + 1)
  end
  redis.call('ZADD', KEYS[2], now, ARGV[1])
  redis.call('PEXPIRE', KEYS[2], window + 1000)
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[1], lease + 1000)
return 0
"""

# Hold a call pool (POOL_ACQUIRE's KEYS[3]) for ARGV[1] ms, the service's word (ARGV[2]) kept as
# its value; a hold already ending later stays as it is (holds only ever lengthen).
POOL_HOLD = """
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[1])
end
return redis.call('PTTL', KEYS[1])
"""
