"""What the test suite and the benchmarks share, so that neither imports the other: loopback
clients, child processes and their CPU time, a real LiteLLM proxy process, the scripted engine,
the real-vLLM stage's engine, and the measurements both run (admission calls, coordination)."""
