-- ARGV[5] model, ARGV[6] lease id. The engine took the request: it no longer counts as pending.
local mk = mkey(ARGV[5])
if redis.call('ZREM', mk .. ':pending', ARGV[6]) == 1 then
  redis.call('INCR', mk .. ':started')
end
return release_model(ARGV[5], {})
