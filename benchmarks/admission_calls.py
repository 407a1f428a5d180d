"""How much code one request's admission runs: Python calls and module switches, counted.

    .venv/bin/python benchmarks/admission_calls.py

What is counted, and how: `fair_sched_plugin.lab.harness.admission_calls` (its test holds the
bounds, tests/runtime/test_service_one_lease.py).
"""

from fair_sched_plugin.lab.harness.admission_calls import main

if __name__ == "__main__":
    main()
