-- ARGV[5] model, ARGV[6] url, ARGV[7] snapshot JSON (started_at waiting running tpot_s kv_usage).
-- Keep the freshest scrape per deployment (every replica scrapes every deployment); settle the
-- leases every deployment's latest scrape must include; then release.
local model, url = ARGV[5], ARGV[6]
local mk = mkey(model)
local snap = cjson.decode(ARGV[7])
local old = redis.call('HGET', mk .. ':snap', url)
if not old or cjson.decode(old).started_at < snap.started_at then
  redis.call('HSET', mk .. ':snap', url, ARGV[7])
  if snap.running > num(redis.call('HGET', mk .. ':cap', url), 0) then
    redis.call('HSET', mk .. ':cap', url, fmt(snap.running))
  end
end
local seen = nil
for _, u in ipairs(POLICY.urls) do
  local raw = redis.call('HGET', mk .. ':snap', u)
  if not raw then seen = nil break end
  local started = cjson.decode(raw).started_at
  if not seen or started < seen then seen = started end
end
if seen then
  -- First bytes every deployment's latest scrape was sent after are running in it.
  redis.call('ZREMRANGEBYSCORE', mk .. ':firstbytes', '-inf', fmt(seen))
  redis.call('ZREMRANGEBYSCORE', mk .. ':pending', '-inf', fmt(seen - POLICY.arrival_grace_s))
end
return release_model(model, {})
