-- Shared by every fair_sched script (prepended at load time). Standalone Redis only: keys are
-- derived from ARGV[1] (the prefix) inside the scripts, which Redis Cluster does not allow.
--
-- ARGV[1] prefix, ARGV[2] replica id, ARGV[3] now (wall-clock seconds), ARGV[4] policy JSON,
-- ARGV[5..] the operation's own arguments.
--
-- Keys (name parts are length-prefixed, `#5:alice`, so no name can forge another's key):
--   P.seq                          ids for tickets, leases and heap pushes
--   P.queued                       tickets queued, all models
--   P.models                       SET of models ever used
--   P.replicas                     ZSET replica -> last heartbeat
--   P.r#..:tickets / :leases       SETs of a replica's queued tickets and live leases
--   P.r#..:grants                  LIST of grants for a replica's waiters ("tid lid charged model")
--   P.tk:<id>                      HASH ticket (model tier user weight cost replica [lease])
--   P.ls:<id>                      HASH lease  (model tier user weight charged replica ticket)
--   P.m#..:queued / :leases / :pending / :snap / :cap / :firstbytes
--   P.m#..t#..:queued / :heap / :member / :vt / :inflight / :tvt / :q#<user>
local P = ARGV[1]
local REPLICA = ARGV[2]
local NOW = tonumber(ARGV[3])
local POLICY = cjson.decode(ARGV[4])

local function enc(name) return '#' .. #name .. ':' .. name end
local function mkey(model) return P .. 'm' .. enc(model) end
local function tkey(model, tier) return mkey(model) .. 't' .. enc(tier) end
local function rkey(replica) return P .. 'r' .. enc(replica) end
local function qkey(tk, user) return tk .. ':q' .. enc(user) end
local function fmt(x) return string.format('%.17g', x) end
local function num(x, default)
  if x then return tonumber(x) end
  return default
end

local function charge(weight, tokens)
  if POLICY.fairness == 'round_robin' then return 1.0 end
  if POLICY.fairness == 'weighted' then return 1.0 / weight end
  return math.max(tokens, 1) / weight
end

-- (virtual_time, push order): the member starts with a zero-padded push sequence, so members
-- with equal scores pop in the order they were pushed, as the in-memory heap does.
local function push(tk, user, vt)
  local seq = redis.call('INCR', P .. 'seq')
  local member = string.format('%016d', seq) .. user
  local old = redis.call('HGET', tk .. ':member', user)
  if old then redis.call('ZREM', tk .. ':heap', old) end
  redis.call('HSET', tk .. ':member', user, member)
  redis.call('ZADD', tk .. ':heap', fmt(vt), member)
end

local function unpush(tk, user)
  local old = redis.call('HGET', tk .. ':member', user)
  if old then
    redis.call('ZREM', tk .. ':heap', old)
    redis.call('HDEL', tk .. ':member', user)
  end
end

local function tier_vt(tk) return num(redis.call('GET', tk .. ':tvt'), 0) end

local function user_vt(tk, user)
  return num(redis.call('HGET', tk .. ':vt', user), tier_vt(tk))
end

-- A user with nothing queued or in flight whose virtual time the tier has caught up with
-- carries no information: drop it so memory follows load.
local function forget_if_idle(tk, user)
  if redis.call('LLEN', qkey(tk, user)) == 0
      and num(redis.call('HGET', tk .. ':inflight', user), 0) <= 0
      and user_vt(tk, user) <= tier_vt(tk) then
    redis.call('HDEL', tk .. ':vt', user)
    redis.call('HDEL', tk .. ':inflight', user)
  end
end

local function count_queued(model, tier, delta)
  redis.call('INCRBY', P .. 'queued', delta)
  redis.call('INCRBY', mkey(model) .. ':queued', delta)
  redis.call('INCRBY', tkey(model, tier) .. ':queued', delta)
end

-- Take a queued ticket out of every structure (cancel, expiry). The ticket must be queued.
local function unqueue(tid, model, tier, user, replica)
  local tk = tkey(model, tier)
  local removed = redis.call('LREM', qkey(tk, user), 1, tid)
  redis.call('DEL', P .. 'tk:' .. tid)
  redis.call('SREM', rkey(replica) .. ':tickets', tid)
  if removed == 0 then return end
  count_queued(model, tier, -1)
  if redis.call('LLEN', qkey(tk, user)) == 0 then
    unpush(tk, user)
    forget_if_idle(tk, user)
  end
end

-- End a lease: in flight and pending no more; the fairness charge corrected (abandoned: given
-- back; token-fair: the actual token count instead of the estimate).
local function end_lease(lid, tokens, abandoned)
  local lk = P .. 'ls:' .. lid
  local f = redis.call('HMGET', lk, 'model', 'tier', 'user', 'weight', 'charged', 'replica', 'ticket')
  if not f[1] then return nil end
  local model, tier, user = f[1], f[2], f[3]
  local weight, charged = tonumber(f[4]), tonumber(f[5])
  local mk, tk = mkey(model), tkey(model, tier)
  redis.call('DEL', lk)
  redis.call('DEL', P .. 'tk:' .. f[7])
  redis.call('SREM', mk .. ':leases', lid)
  redis.call('ZREM', mk .. ':pending', lid)
  redis.call('SREM', rkey(f[6]) .. ':leases', lid)
  local left = redis.call('HINCRBY', tk .. ':inflight', user, -1)
  if left <= 0 then redis.call('HDEL', tk .. ':inflight', user) end
  local correction = 0
  if abandoned then
    correction = -charged
  elseif tokens >= 0 and POLICY.fairness == 'tokens' then
    correction = charge(weight, tokens) - charged
  end
  if correction ~= 0 then
    local vt = math.max(tier_vt(tk), user_vt(tk, user) + correction)
    redis.call('HSET', tk .. ':vt', user, fmt(vt))
    if redis.call('HEXISTS', tk .. ':member', user) == 1 then push(tk, user, vt) end
  end
  forget_if_idle(tk, user)
  return model
end

-- Why this tier may not release now (false: it may). Exactly the rules of core/backpressure.py:
-- fresh metrics: waiting + pending < waiting_below * deployments, worst TPOT and KV below the
-- tier's ceilings; metrics missing or stale: an in-flight cap; no metrics URL: another cap.
local function blocked(mk, tier)
  local inflight = redis.call('SCARD', mk .. ':leases')
  local deployments = #POLICY.urls
  if deployments == 0 then
    if inflight < POLICY.unknown_cap then return false end
    return 'unknown_inflight'
  end
  local waiting, free, tpot, kv = 0, 0, nil, nil
  for _, url in ipairs(POLICY.urls) do
    local raw = redis.call('HGET', mk .. ':snap', url)
    local snap = raw and cjson.decode(raw)
    if not snap or NOW - snap.started_at > POLICY.stale_after_s then
      if inflight < POLICY.fallback_cap * deployments then return false end
      return 'fallback_inflight'
    end
    waiting = waiting + snap.waiting
    -- Free running slots: the most seen running (learned capacity) less those running now.
    local capacity = num(redis.call('HGET', mk .. ':cap', url), 0)
    if capacity > snap.running then free = free + capacity - snap.running end
    if snap.tpot_s and (not tpot or snap.tpot_s > tpot) then tpot = snap.tpot_s end
    if snap.kv_usage and (not kv or snap.kv_usage > kv) then kv = snap.kv_usage end
  end
  -- Slots taken by first bytes that not every deployment's latest scrape was sent after are not
  -- free (a first byte while a scrape is on its way must not be forgotten by it).
  free = math.max(0, free - redis.call('ZCARD', mk .. ':firstbytes'))
  local pending = redis.call('ZCARD', mk .. ':pending')
  -- The engine fills free slots from its own queue first; ours take what is left.
  local left_free = math.max(0, free - waiting)
  local queued = math.max(0, waiting - free) + math.max(0, pending - left_free)
  if queued >= tier.waiting_below * deployments then return 'waiting' end
  if tier.tpot_below_s and tpot and tpot >= tier.tpot_below_s then return 'tpot' end
  if tier.kv_usage_below and kv and kv >= tier.kv_usage_below then return 'kv_usage' end
  return false
end

-- Grant the head ticket of the tier's lowest-virtual-time user.
local function grant_next(model, tier, out)
  local mk, tk = mkey(model), tkey(model, tier)
  local head = redis.call('ZRANGE', tk .. ':heap', 0, 0)[1]
  local user = string.sub(head, 17)
  unpush(tk, user)
  local q = qkey(tk, user)
  local tid = redis.call('LPOP', q)
  count_queued(model, tier, -1)
  local t = redis.call('HMGET', P .. 'tk:' .. tid, 'weight', 'cost', 'replica')
  local weight, cost, replica = tonumber(t[1]), tonumber(t[2]), t[3]
  -- The start tag of the request now in service is the tier's virtual time.
  local vt = user_vt(tk, user)
  if vt > tier_vt(tk) then redis.call('SET', tk .. ':tvt', fmt(vt)) end
  local charged = charge(weight, cost)
  vt = vt + charged
  redis.call('HSET', tk .. ':vt', user, fmt(vt))
  redis.call('HINCRBY', tk .. ':inflight', user, 1)
  local lid = redis.call('INCR', P .. 'seq')
  redis.call('HSET', P .. 'ls:' .. lid, 'model', model, 'tier', tier, 'user', user,
    'weight', fmt(weight), 'charged', fmt(charged), 'replica', replica, 'ticket', tid)
  redis.call('HSET', P .. 'tk:' .. tid, 'lease', lid)
  redis.call('SREM', rkey(replica) .. ':tickets', tid)
  redis.call('SADD', rkey(replica) .. ':leases', lid)
  redis.call('SADD', mk .. ':leases', lid)
  redis.call('ZADD', mk .. ':pending', fmt(NOW), lid)
  if redis.call('LLEN', q) > 0 then push(tk, user, vt) end
  local grant = tid .. ' ' .. lid .. ' ' .. fmt(charged) .. ' ' .. model
  if replica == REPLICA then
    table.insert(out, grant)
  else
    local grants = rkey(replica) .. ':grants'
    redis.call('RPUSH', grants, grant)
    redis.call('PEXPIRE', grants, math.floor(POLICY.lease_ttl_s * 1000))
  end
end

-- Release while the gate allows: highest releasable tier first, fairness order inside it.
-- Returns the grants for the calling replica; the others' go to their grant lists.
local function release_model(model, out)
  local mk = mkey(model)
  for _ = 1, 100000 do
    if num(redis.call('GET', mk .. ':queued'), 0) <= 0 then return out end
    local released = false
    for _, tier in ipairs(POLICY.tiers) do
      if num(redis.call('GET', tkey(model, tier.name) .. ':queued'), 0) > 0
          and not blocked(mk, tier) then
        grant_next(model, tier.name, out)
        released = true
        break
      end
    end
    if not released then return out end
  end
  return out
end
