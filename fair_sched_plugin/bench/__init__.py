"""Benchmarks and the flood demo: load generation, the scenarios of DESIGN.md, reports, plots.

Nothing here is imported by the scheduler itself. Plotting needs the ``bench`` extra
(matplotlib) and is imported only inside :mod:`fair_sched_plugin.bench.plots`' functions.
"""
