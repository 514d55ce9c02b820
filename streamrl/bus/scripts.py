"""Lua scripts: every state change that must be atomic with an XACK happens in one of these.

The fence. An entry of a stream belongs to the consumer that the consumer group's pending list
(PEL) says holds it, and each (re)delivery bumps the PEL's delivery counter. A worker remembers
the counter it was handed (its *fence*) and every write checks both the owner and the counter,
so a worker that lost its entry to ``XAUTOCLAIM`` (or an older coroutine of the same worker)
can never write a session, a trajectory or a score for it. Because result and ack are written
together, a redelivered entry cannot produce a second result either.

Every script takes many items, so a worker pays one round trip per batch, not per episode.

Kept whole: every script is built from the same Lua prelude (the batch fence, ``take``,
``many``), and reading one next to the others is how a change to the fence is checked.
"""

from __future__ import annotations

# The fence, checked for a whole batch at once: one XPENDING over the range of the batch's entry
# IDs, restricted to this consumer, reads the delivery count of every entry of the batch that
# this consumer holds (entries held by others, acked or never delivered are simply absent).
# ``take`` then checks one entry and removes it from the map, so an entry named twice in one
# batch is written once. ``many`` sends a command with a long list of arguments in chunks
# (Lua's unpack stops at a few thousand values).
_HELD = """
local function held(stream, group, consumer, ids)
  local out = {}
  if #ids == 0 then return out end
  local lo, hi, lom, los, him, his
  for _, id in ipairs(ids) do
    local ms, seq = string.match(id, '^(%d+)-?(%d*)$')
    ms, seq = tonumber(ms), tonumber(seq) or 0
    if not lo or ms < lom or (ms == lom and seq < los) then lo, lom, los = id, ms, seq end
    if not hi or ms > him or (ms == him and seq > his) then hi, him, his = id, ms, seq end
  end
  local p = redis.call('XPENDING', stream, group, lo, hi, 1000000000, consumer)
  for _, e in ipairs(p) do out[e[1]] = tonumber(e[4]) end
  return out
end
local function take(h, id, fence)
  if h[id] ~= nil and h[id] == tonumber(fence) then h[id] = nil; return true end
  return false
end
local function many(head, list, tail)
  for j = 1, #list, 1000 do
    local args = {}
    for _, a in ipairs(head) do args[#args + 1] = a end
    for x = j, math.min(j + 999, #list) do args[#args + 1] = list[x] end
    for _, a in ipairs(tail or {}) do args[#args + 1] = a end
    redis.call(unpack(args))
  end
end
"""

# KEYS[1]=stream. ARGV: group, consumer, min_idle_ms, count, cursor, mode ('stale'|'own'),
# session_prefix ('' for none). Returns {next_cursor, {{id, task_id, payload, deliveries,
# session|false}, ...}, {deleted ids}}. Claiming bumps each entry's delivery count: one
# XPENDING reads the new counts (the fences) of all of them, one MGET their sessions.
CLAIM = (
    _HELD
    + """
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
local rows, ids = {}, {}
for _, e in ipairs(entries) do
  local id, f = e[1], e[2]
  if f then
    local tid, payload = '', ''
    for j = 1, #f, 2 do
      if f[j] == 'id' then tid = f[j + 1] elseif f[j] == 'p' then payload = f[j + 1] end
    end
    rows[#rows + 1] = {id, tid, payload}
    ids[#ids + 1] = id
  end
end
local h = held(stream, group, consumer, ids)
local sessions = {}
if sprefix ~= '' then
  for j = 1, #rows, 1000 do
    local ks = {}
    for x = j, math.min(j + 999, #rows) do ks[#ks + 1] = sprefix .. rows[x][2] end
    for _, v in ipairs(redis.call('MGET', unpack(ks))) do sessions[#sessions + 1] = v end
  end
end
local out = {}
for i, row in ipairs(rows) do
  out[i] = {row[1], row[2], row[3], h[row[1]] or 0, sessions[i] or false}
end
return {nextc, out, deleted}
"""
)

# KEYS[1]=stream. ARGV: group, consumer, then pairs (id, fence). Re-touches owned entries so
# they do not look idle (one XCLAIM ... JUSTID for all of them); returns the ids this consumer
# no longer owns.
HEARTBEAT = (
    _HELD
    + """
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local ids = {}
for i = 3, #ARGV, 2 do ids[#ids + 1] = ARGV[i] end
local h = held(stream, group, consumer, ids)
local keep, lost = {}, {}
for i = 3, #ARGV, 2 do
  if h[ARGV[i]] ~= nil and h[ARGV[i]] == tonumber(ARGV[i + 1]) then
    keep[#keep + 1] = ARGV[i]
  else
    lost[#lost + 1] = ARGV[i]
  end
end
many({'XCLAIM', stream, group, consumer, 0}, keep, {'JUSTID'})
return lost
"""
)

# KEYS[1]=tasks, KEYS[2..]=session keys. ARGV: group, consumer, ttl, then (id, fence, blob).
# A blob is a whole session (the plain msgpack form, or a packed frame at offset 0: SET) or a
# frame that appends to the session's value at the offset its header names (``schema``'s
# packed form: 0xC1, format, uint32 LE offset, length). A frame is appended only where the
# value is exactly that long; a frame already there (a re-sent checkpoint) is left as it is.
# The client sends only the frame: a checkpoint's bytes are what its turn added.
# Returns per item 1 (written), 0 (not owned) or 2 (the value is not the one this worker
# appends to, an expired session: the worker writes the whole session again).
COMMIT = (
    _HELD
    + """
local stream, group, consumer, ttl = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local function offset(blob)
  if #blob < 10 or string.byte(blob, 1) ~= 0xC1 then return 0 end
  local a, b, c, d = string.byte(blob, 3, 6)
  return a + b * 256 + c * 65536 + d * 16777216
end
local ids = {}
for i = 1, #KEYS - 1 do ids[i] = ARGV[4 + (i - 1) * 3] end
local h = held(stream, group, consumer, ids)
local out = {}
for i = 1, #KEYS - 1 do
  local a = 4 + (i - 1) * 3
  local key, blob = KEYS[i + 1], ARGV[a + 2]
  -- the same entry twice in one batch: both checkpoints pass the fence, in order
  if h[ARGV[a]] == nil or h[ARGV[a]] ~= tonumber(ARGV[a + 1]) then
    out[i] = 0
  else
    local at = offset(blob)
    if at == 0 then
      redis.call('SET', key, blob, 'EX', ttl)
      out[i] = 1
    else
      -- GET and SET rather than APPEND: an appended string keeps up to as much room again
      -- for growth, which an open session would hold for its whole life
      local v = redis.call('GET', key)
      if v and #v == at then
        redis.call('SET', key, v .. blob, 'EX', ttl)
        out[i] = 1
      elseif v and #v == at + #blob and string.sub(v, at + 1) == blob then
        redis.call('EXPIRE', key, ttl)
        out[i] = 1
      else
        out[i] = 2
      end
    end
  end
end
return out
"""
)

# KEYS: tasks, rollouts, stats, then session keys. ARGV: group, consumer, then
# (id, fence, task_id, trajectory blob). Writes the trajectory and acks the task in one step;
# the acks and the session deletes of the batch go in one XACK and one DEL.
FINISH = (
    _HELD
    + """
local tasks, rollouts, stats = KEYS[1], KEYS[2], KEYS[3]
local group, consumer = ARGV[1], ARGV[2]
local ids = {}
for i = 1, #KEYS - 3 do ids[i] = ARGV[3 + (i - 1) * 4] end
local h = held(tasks, group, consumer, ids)
local out, acks, dels = {}, {}, {}
for i = 1, #KEYS - 3 do
  local a = 3 + (i - 1) * 4
  if take(h, ARGV[a], ARGV[a + 1]) then
    redis.call('XADD', rollouts, '*', 'id', ARGV[a + 2], 'p', ARGV[a + 3])
    acks[#acks + 1] = ARGV[a]
    dels[#dels + 1] = KEYS[i + 3]
    out[i] = 1
  else
    out[i] = 0
  end
end
many({'XACK', tasks, group}, acks)
many({'DEL'}, dels)
if #acks > 0 then redis.call('HINCRBY', stats, 'trajectories', #acks) end
return out
"""
)

# A group's hash while it fills: ``s<k>`` (the Sample's bytes), ``r<k>`` (its reward), ``size``
# and ``n`` (samples so far). Once the group is written to `groups`, or dropped, the key is
# replaced by a plain string marker, ``done`` or ``dropped``, with a TTL (one SET, where a hash
# marker took DEL, HSET and EXPIRE). A hash read of the marker is a WRONGTYPE error, which is
# how the scripts see a closed group (``redis.pcall``); a hash with a ``state`` field (the
# marker of streamrl before 2026-11-25) reads as closed too.
_GROUPS = """
local function closed(gk)
  local v = redis.pcall('HGET', gk, 'state')
  return v ~= false
end
"""

# KEYS: rollouts, scored, groups, stats, then group keys. ARGV: group, consumer, schema
# version, done ttl, then (id, fence, task_id, prompt_id, k, group_size, reward, score blob,
# sample blob). Returns per item 1 (added), 2 (duplicate or group already closed; acked), 0 (not
# owned), 3 (impossible: k outside [0, group_size), a reward that is not a finite number, or a
# group_size other than the group's first sample's; not acked, the caller dead-letters it).
# When the last sample of a group arrives, the Group is written to `groups` once:
# a msgpack array [v, prompt_id, group_size, mean, std, [samples...]] built from the samples'
# own bytes. Each group of the batch is read once (one HMGET) and written once (one HSET, or
# the group itself and its marker when it completes).
SCORE = (
    _HELD
    + _GROUPS
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
  return not have or have == size
end
local items, ids, wanted = {}, {}, {}
for i = 1, #KEYS - 4 do
  local a = 5 + (i - 1) * 9
  local it = {id = ARGV[a], fence = ARGV[a + 1], tid = ARGV[a + 2], pid = ARGV[a + 3],
    k = tonumber(ARGV[a + 4]), size = tonumber(ARGV[a + 5]), reward = tonumber(ARGV[a + 6]),
    rs = ARGV[a + 6], score = ARGV[a + 7], sample = ARGV[a + 8], gk = KEYS[4 + i]}
  items[i], ids[i] = it, it.id
  wanted[it.gk] = wanted[it.gk] or {}
  if it.k then table.insert(wanted[it.gk], it.k) end
end
local h = held(rollouts, group, consumer, ids)
-- a group's state, read once per batch: its size, count, whether it is closed, which of the
-- batch's slots it already holds
local cache = {}
local function load(gk)
  local fields = {'size', 'n', 'state'}
  for _, k in ipairs(wanted[gk]) do fields[#fields + 1] = 'r' .. k end
  local v = redis.pcall('HMGET', gk, unpack(fields))
  local g = {n = 0, closed = true, have = {}, new = {}}
  if v.err == nil then
    g.size, g.n, g.closed = tonumber(v[1]), tonumber(v[2]) or 0, v[3] ~= false
    for j, k in ipairs(wanted[gk]) do if v[3 + j] then g.have[k] = true end end
  end
  cache[gk] = g
  return g
end
local function complete(g, it)
  local size, samples, rewards, need = it.size, {}, {}, {}
  for _, x in ipairs(g.new) do samples[x.k] = x.sample; rewards[x.k] = x.rs end
  for j = 0, size - 1 do
    if not samples[j] then need[#need + 1] = j end
  end
  if #need > 0 then
    local f = {}
    for _, j in ipairs(need) do f[#f + 1] = 's' .. j; f[#f + 1] = 'r' .. j end
    local v = redis.call('HMGET', it.gk, unpack(f))
    for x, j in ipairs(need) do samples[j] = v[2 * x - 1]; rewards[j] = v[2 * x] end
  end
  local sum, sq, ordered = 0, 0, {}
  for j = 0, size - 1 do sum = sum + tonumber(rewards[j]) end
  local mean = sum / size
  for j = 0, size - 1 do
    sq = sq + (tonumber(rewards[j]) - mean) ^ 2
    ordered[j + 1] = samples[j]
  end
  local std = math.sqrt(sq / size)
  local head = string.char(0x96) .. cmsgpack.pack(version, it.pid, size, mean + 0.0, std + 0.0)
  local body = head .. arrhdr(size) .. table.concat(ordered)
  redis.call('XADD', groups, '*', 'id', it.pid, 'p', body)
  redis.call('SET', it.gk, 'done', 'EX', done_ttl)
  g.closed = true
end
local out, acks, added, dup, done = {}, {}, 0, 0, 0
for i, it in ipairs(items) do
  if not (h[it.id] ~= nil and h[it.id] == tonumber(it.fence)) then
    out[i] = 0
  else
    local g = cache[it.gk] or load(it.gk)
    if not valid(it.k, it.size, it.reward, g.size) then
      out[i] = 3
    else
      h[it.id] = nil
      acks[#acks + 1] = it.id
      if g.closed or g.have[it.k] then
        out[i] = 2; dup = dup + 1
      else
        redis.call('XADD', scored, '*', 'id', it.tid, 'p', it.score)
        g.have[it.k] = true
        g.new[#g.new + 1] = it
        g.size, g.n = it.size, g.n + 1
        out[i] = 1; added = added + 1
        if g.n == it.size then
          complete(g, it)
          done = done + 1
        end
      end
    end
  end
end
many({'XACK', rollouts, group}, acks)
for gk, g in pairs(cache) do
  if not g.closed and #g.new > 0 then
    local f = {'HSET', gk}
    for _, x in ipairs(g.new) do
      f[#f + 1] = 's' .. x.k; f[#f + 1] = x.sample; f[#f + 1] = 'r' .. x.k; f[#f + 1] = x.rs
    end
    f[#f + 1] = 'size'; f[#f + 1] = g.size; f[#f + 1] = 'n'; f[#f + 1] = g.n
    redis.call(unpack(f))
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
    _HELD
    + _GROUPS
    + """
local stream, dead, scored, stats = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, consumer, done_ttl = ARGV[1], ARGV[2], ARGV[3]
local nitems = (#KEYS - 4) / 2
local ids = {}
for i = 1, nitems do ids[i] = ARGV[4 + (i - 1) * 5] end
local h = held(stream, group, consumer, ids)
local out, acks, dels, dropped = {}, {}, {}, 0
for i = 1, nitems do
  local a = 4 + (i - 1) * 5
  local id, fence, tid = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local sk, gk = KEYS[4 + (i - 1) * 2 + 1], KEYS[4 + (i - 1) * 2 + 2]
  if take(h, id, fence) then
    redis.call('XADD', dead, '*', 'id', tid, 'p', ARGV[a + 3])
    if ARGV[a + 4] ~= '' then redis.call('XADD', scored, '*', 'id', tid, 'p', ARGV[a + 4]) end
    acks[#acks + 1] = id
    dels[#dels + 1] = sk
    if not closed(gk) then
      redis.call('SET', gk, 'dropped', 'EX', done_ttl)
      dropped = dropped + 1
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
many({'XACK', stream, group}, acks)
many({'DEL'}, dels)
if #acks > 0 then redis.call('HINCRBY', stats, 'dead_letters', #acks) end
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

# The slots of one policy server (``streamrl.policy.server_slots``): at most ARGV[3] requests
# of every rollout worker of a run on it at once. A slot is a lease that ends ARGV[2] ms after
# it was taken or last renewed (``SLOT_RENEW``); the holder renews it while its request runs,
# so a holder killed mid-request frees its slot when the lease ends, swept here by the next
# caller. Redis's clock, not the callers'. Asking again with an id that already holds a slot
# (a retried call) keeps it.
# First come, first served: a request that has to wait joins a queue (KEYS[2]) and takes a
# slot only when the slots free are more than the requests that asked before it. Without the
# queue, a worker whose requests give a slot back and ask again at once kept every slot while
# other workers' polls missed the moment (a worker starved for minutes). A waiter stays queued
# while it asks again within ARGV[4] ms (KEYS[3]); one that stopped asking (killed) leaves.
# KEYS[1]=slots zset (member: request id, score: lease end, ms), KEYS[2]=queue zset (member:
# request id, score: when it first asked, µs, strictly increasing), KEYS[3]=zset request id ->
# when it leaves the queue.
# ARGV: request id, lease_ms, limit, wait_ttl_ms. Returns 0 when the request holds a slot, else
# about how many ms until the earliest lease ends (a slot usually frees sooner: a request gives
# its slot back when it ends), or ARGV[4] when the free slots go to earlier waiters.
SLOT_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, limit, wait_ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, w in ipairs(gone) do redis.call('ZREM', KEYS[2], w) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local held, queued = redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2])
local ahead = redis.call('ZRANK', KEYS[2], ARGV[1]) or queued
if held + ahead >= limit then
  if ahead == queued then  -- joins the queue: after the last, strictly
    local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
    local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
    redis.call('ZADD', KEYS[2], last[2] and math.max(us, tonumber(last[2]) + 1) or us, ARGV[1])
  end
  redis.call('ZADD', KEYS[3], now + wait_ttl, ARGV[1])
  redis.call('PEXPIRE', KEYS[2], wait_ttl + 1000)
  redis.call('PEXPIRE', KEYS[3], wait_ttl + 1000)
  if held < limit then return wait_ttl end
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return math.max(1, tonumber(first[2]) - now)
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[1], lease + 1000)
return 0
"""

# Renew the leases of the slots a holder still has (SLOT_ACQUIRE's KEYS[1]). ARGV: lease_ms,
# request ids. A lease that already ended (its holder stalled longer than a lease) is not
# taken back: its id is returned, the holder's request is then over the bound until it ends.
SLOT_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local lost = {}
for j = 2, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[j])
  if score and tonumber(score) > now then
    redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[j])
  else
    redis.call('ZREM', KEYS[1], ARGV[j])
    lost[#lost + 1] = ARGV[j]
  end
end
redis.call('PEXPIRE', KEYS[1], lease + 1000)
return lost
"""

# Which of a run's policy servers (``[policy] base_url`` as a list) a rollout worker talks to:
# the one it was given while its assignment lives (a worker keeps its server across leases),
# else the one fewest live workers were given (the first of them on a tie). An assignment
# lives ARGV[2] ms after the worker last asked; the worker asks again well before, so a worker
# that is gone stops counting that long after. One script: two workers asking at once cannot
# both take the emptiest server.
# KEYS[1]=hash worker -> server URL, KEYS[2]=zset worker -> when the assignment ends (Redis
# ms). ARGV: worker, ttl_ms, the server it talks to now ('' before its first pick: a worker
# whose assignment ended mid-lease keeps its server), server URLs. Returns its server URL.
SERVER_PICK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, w in ipairs(gone) do redis.call('HDEL', KEYS[1], w) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local count = {}
for j = 4, #ARGV do count[ARGV[j]] = 0 end
local mine = redis.call('HGET', KEYS[1], ARGV[1])
if not (mine and count[mine]) and count[ARGV[3]] then
  mine = ARGV[3]
  redis.call('HSET', KEYS[1], ARGV[1], mine)
elseif not (mine and count[mine]) then
  local all = redis.call('HGETALL', KEYS[1])
  for j = 1, #all, 2 do
    if all[j] ~= ARGV[1] and count[all[j + 1]] then count[all[j + 1]] = count[all[j + 1]] + 1 end
  end
  mine = ARGV[4]
  for j = 5, #ARGV do
    if count[ARGV[j]] < count[mine] then mine = ARGV[j] end
  end
  redis.call('HSET', KEYS[1], ARGV[1], mine)
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
local ttl = tonumber(ARGV[2]) + 1000
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return mine
"""
