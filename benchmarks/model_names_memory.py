"""Memory retained by 10,000 distinct client-chosen model names through SchedulingService.

PYTHONPATH=$PWD python benchmarks/model_names_memory.py
"""

from __future__ import annotations

import asyncio
import tracemalloc

from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.service import SchedulingService


async def main() -> None:
    svc = SchedulingService({"principals": [{"name": "a", "keys": ["sk-a"]}]})
    p = svc.identify(Credentials(api_key="sk-a"))
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    for i in range(100):
        (await svc.admit(p, f"warm-{i}", body)).lease.release()
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    for i in range(10_000):
        name = f"{i:06d}-" + "x" * 249
        (await svc.admit(p, name, body)).lease.release()
    after = tracemalloc.take_snapshot()
    diff = sum(s.size_diff for s in after.compare_to(base, "filename"))
    print(f"10,000 distinct 256-char model names: +{diff / 1024:.1f} KiB retained")
    await svc.aclose()


asyncio.run(main())
