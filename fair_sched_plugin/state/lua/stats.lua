-- ARGV[5] JSON list of tier names. Returns {queued, replicas, model, queued, in_flight, pending,
-- n_tiers, tier, queued, ...}.
local tiers = cjson.decode(ARGV[5])
local out = {num(redis.call('GET', P .. 'queued'), 0), redis.call('ZCARD', P .. 'replicas')}
for _, model in ipairs(redis.call('SMEMBERS', P .. 'models')) do
  local mk = mkey(model)
  table.insert(out, model)
  table.insert(out, num(redis.call('GET', mk .. ':queued'), 0))
  table.insert(out, redis.call('SCARD', mk .. ':leases'))
  table.insert(out, redis.call('ZCARD', mk .. ':pending'))
  table.insert(out, #tiers)
  for _, tier in ipairs(tiers) do
    table.insert(out, tier)
    table.insert(out, num(redis.call('GET', tkey(model, tier) .. ':queued'), 0))
  end
end
return out
