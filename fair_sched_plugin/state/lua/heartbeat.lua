-- KEYS: replicas (sorted set by expiry, Redis's own clock). ARGV: replica, ttl ms.
-- Marks the replica alive, forgets the silent ones, returns {what was corrupt ('' if nothing),
-- the replicas alive}. A deadline more than two TTLs ahead is nobody's (each replica writes
-- now + TTL): forgotten too.
local corrupt = ''
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'zset' and kind ~= 'none' then
  redis.call('DEL', KEYS[1])
  corrupt = 'not a sorted set'
end
local now = redis.call('TIME')
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
redis.call('ZADD', KEYS[1], ms + ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
if redis.call('ZREMRANGEBYSCORE', KEYS[1], '(' .. (ms + 2 * ARGV[2]), '+inf') > 0 then
  corrupt = 'a deadline beyond two TTLs'
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {corrupt, redis.call('ZRANGE', KEYS[1], 0, -1)}
