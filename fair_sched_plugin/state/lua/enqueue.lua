-- ARGV[5..] model, tier, user, weight, cost. Queue a ticket, then release what the gate allows.
-- Returns {'full', scope} or {'ok', ticket_id, grant...}.
local model, tier, user = ARGV[5], ARGV[6], ARGV[7]
local weight, cost = tonumber(ARGV[8]), tonumber(ARGV[9])
local tk = tkey(model, tier)
local q = qkey(tk, user)
local depth = redis.call('LLEN', q)
if depth >= POLICY.max_per_user then return {'full', 'user'} end
if num(redis.call('GET', P .. 'queued'), 0) >= POLICY.max_total then return {'full', 'total'} end
local tid = tostring(redis.call('INCR', P .. 'seq'))
redis.call('HSET', P .. 'tk:' .. tid, 'model', model, 'tier', tier, 'user', user,
  'weight', fmt(weight), 'cost', tostring(cost), 'replica', REPLICA)
redis.call('SADD', rkey(REPLICA) .. ':tickets', tid)
redis.call('SADD', P .. 'models', model)
if depth == 0 then
  -- A user coming back from idle starts at the tier's virtual time: no banked credit.
  local vt = math.max(user_vt(tk, user), tier_vt(tk))
  redis.call('HSET', tk .. ':vt', user, fmt(vt))
  push(tk, user, vt)
end
redis.call('RPUSH', q, tid)
count_queued(model, tier, 1)
return release_model(model, {'ok', tid})
