-- KEYS: leader, epoch counter. ARGV: replica, ttl ms. Take the lease if nobody holds it.
-- Returns the holder's token ("<epoch>:<replica>"), ours if we just took it.
local holder = redis.call('GET', KEYS[1])
if holder then return holder end
local token = redis.call('INCR', KEYS[2]) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
return token
