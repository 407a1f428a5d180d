-- KEYS: leader, then each replica's reply list. ARGV: token, ttl ms, then per list its number of
-- replies, then the replies. Fenced: a deposed leader (its token no longer in the leader key)
-- can never hand out a grant. Returns {1, the reply lists that held another type and were
-- replaced}, or {0} when fenced out.
if redis.call('TYPE', KEYS[1]).ok ~= 'string' or redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {0}
end
local replaced = {1}
local lists = #KEYS - 1
local at = 3 + lists
for i = 1, lists do
  local kind = redis.call('TYPE', KEYS[i + 1]).ok
  if kind ~= 'list' and kind ~= 'none' then
    redis.call('DEL', KEYS[i + 1])
    table.insert(replaced, KEYS[i + 1])
  end
  local count = tonumber(ARGV[2 + i])
  redis.call('RPUSH', KEYS[i + 1], unpack(ARGV, at, at + count - 1))
  redis.call('PEXPIRE', KEYS[i + 1], ARGV[2])
  at = at + count
end
return replaced
