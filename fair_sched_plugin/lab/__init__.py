"""Tooling beside the scheduler, not on a request's path: the demo, the load tests of
`fair-sched bench`, the engine emulator, and the harness that tests and benchmarks share."""
