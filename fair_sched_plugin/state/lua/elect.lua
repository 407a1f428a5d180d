-- KEYS: leader, epoch counter. ARGV: replica, ttl ms. Take the lease if nobody holds a valid
-- one. Returns {holder's token ("<epoch>:<replica>", ours if we just took it), what was corrupt
-- and replaced: "leader" and/or "epoch"}. A leader value of another type, not a token, or
-- without a TTL is nobody's lease (we always set one with PX); an epoch that INCR refuses
-- restarts at Redis's clock in ms, above any counter handed out before.
local replaced = {}
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'string' then
  local holder = redis.call('GET', KEYS[1])
  local epoch = string.match(holder, '^(%d+):.')
  if epoch and #epoch <= 15 and #holder <= 512 and redis.call('PTTL', KEYS[1]) > 0 then
    return {holder}
  end
end
if kind ~= 'none' then
  redis.call('DEL', KEYS[1])
  table.insert(replaced, 'leader')
end
kind = redis.call('TYPE', KEYS[2]).ok
if kind ~= 'none' then
  local counter = kind == 'string' and redis.call('STRLEN', KEYS[2]) <= 15
    and string.match(redis.call('GET', KEYS[2]), '^%d+$')
  if not counter then
    local now = redis.call('TIME')
    redis.call('DEL', KEYS[2])
    redis.call('SET', KEYS[2], now[1] * 1000 + math.floor(now[2] / 1000))
    table.insert(replaced, 'epoch')
  end
end
local token = redis.call('INCR', KEYS[2]) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
return {token, unpack(replaced)}
