-- ARGV[5] ticket id. Returns {'cancelled'}, {'gone'} or {'granted', lease_id, model}: a ticket granted
-- before its cancel arrived keeps its lease, which the caller then abandons.
local tid = ARGV[5]
local t = redis.call('HMGET', P .. 'tk:' .. tid, 'model', 'tier', 'user', 'replica', 'lease')
if not t[1] then return {'gone'} end
if t[5] then return {'granted', t[5], t[1]} end
unqueue(tid, t[1], t[2], t[3], t[4])
return {'cancelled'}
