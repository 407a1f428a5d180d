-- ARGV[5] model, ARGV[6] lease id, ARGV[7] tokens used (-1: unknown), ARGV[8] '1' if abandoned.
-- Ending an unknown (already ended or expired) lease changes nothing: ends are idempotent.
end_lease(ARGV[6], tonumber(ARGV[7]), ARGV[8] == '1')
return release_model(ARGV[5], {})
