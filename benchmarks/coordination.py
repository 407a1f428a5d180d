"""The leader's ceiling: admissions per second one leader decides for K follower processes.

    .venv/bin/python benchmarks/coordination.py --quick # K = 1, 2; 3 rates; 1 s steps
    .venv/bin/python benchmarks/coordination.py         # K = 1, 2, 4, 8; to 16000/s; 3 runs of 3 s
    .venv/bin/python benchmarks/coordination.py --followers 4 --rates 500,1000 --duration 5

What it measures, and how: `fair_sched_plugin.lab.harness.coordination` (its test runs it at
a tiny size, tests/state/test_coordination_bench.py).
"""

from fair_sched_plugin.lab.harness.coordination import cli

if __name__ == "__main__":
    cli()
