-- KEYS: replicas (sorted set by expiry, Redis's own clock). ARGV: replica, ttl ms.
-- Marks the replica alive, forgets the silent ones, returns those alive.
local now = redis.call('TIME')
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
redis.call('ZADD', KEYS[1], ms + ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return redis.call('ZRANGE', KEYS[1], 0, -1)
