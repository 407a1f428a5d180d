-- ARGV[5] model, ARGV[6] lease id. The engine took the request: it no longer counts as pending.
redis.call('ZREM', mkey(ARGV[5]) .. ':pending', ARGV[6])
return release_model(ARGV[5], {})
