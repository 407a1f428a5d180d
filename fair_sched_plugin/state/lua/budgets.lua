-- KEYS: leader, budgets. ARGV: token, ttl ms, budget snapshot. Only the lease holder writes.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
return 1
