"""fair-sched-plugin: fair, backpressure-aware request scheduling for self-hosted LLM engines."""

from __future__ import annotations

__version__ = "0.1.0"
