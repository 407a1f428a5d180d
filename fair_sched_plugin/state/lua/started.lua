-- ARGV[5] model, ARGV[6] lease id. The engine took the request: it no longer counts as pending.
local mk = mkey(ARGV[5])
local lk = P .. 'ls:' .. ARGV[6]
if redis.call('EXISTS', lk) == 1 then redis.call('HSET', lk, 'started', 1) end
if redis.call('ZREM', mk .. ':pending', ARGV[6]) == 1 then
  redis.call('INCR', mk .. ':started')
end
return release_model(ARGV[5], {})
