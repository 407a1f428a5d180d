-- ARGV[5] ttl seconds. Record this replica as alive; purge every replica silent for longer than
-- the TTL (its queued tickets leave the queues, its leases end). Returns the models touched.
local ttl = tonumber(ARGV[5])
redis.call('ZADD', P .. 'replicas', fmt(NOW), REPLICA)
local dead = redis.call('ZRANGEBYSCORE', P .. 'replicas', '-inf', '(' .. fmt(NOW - ttl))
local touched = {}
for _, replica in ipairs(dead) do
  local rk = rkey(replica)
  for _, tid in ipairs(redis.call('SMEMBERS', rk .. ':tickets')) do
    local t = redis.call('HMGET', P .. 'tk:' .. tid, 'model', 'tier', 'user')
    if t[1] then
      unqueue(tid, t[1], t[2], t[3], replica)
      touched[t[1]] = true
    end
  end
  for _, lid in ipairs(redis.call('SMEMBERS', rk .. ':leases')) do
    local model = end_lease(lid, -1, false)
    if model then touched[model] = true end
  end
  redis.call('DEL', rk .. ':tickets', rk .. ':leases', rk .. ':grants')
  redis.call('ZREM', P .. 'replicas', replica)
end
local out = {}
for model, _ in pairs(touched) do table.insert(out, model) end
return out
