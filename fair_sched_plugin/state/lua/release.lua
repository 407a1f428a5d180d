-- ARGV[5] model. Release what the gate allows; returns the caller's grants.
return release_model(ARGV[5], {})
