"""Benchmarks and the flood demo: load generation, the scenarios of `fair-sched bench`
(docs/results.md), reports, plots.

Nothing here is imported by the scheduler itself. Plotting needs the ``bench`` extra
(matplotlib) and is imported only inside :mod:`fair_sched_plugin.lab.loadtest.plots`' functions.
"""
