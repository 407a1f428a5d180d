-- ARGV[5] model, ARGV[6] lease id. The engine took the request: it no longer counts as pending.
local mk = mkey(ARGV[5])
if redis.call('ZREM', mk .. ':pending', ARGV[6]) == 1 then
  redis.call('ZADD', mk .. ':firstbytes', fmt(NOW), ARGV[6])
  -- Older than any fresh scrape can be: they no longer matter (bounded in an outage).
  redis.call('ZREMRANGEBYSCORE', mk .. ':firstbytes', '-inf', '(' .. fmt(NOW - POLICY.stale_after_s))
end
return release_model(ARGV[5], {})
