"""How much code one request's admission runs: Python calls and module switches, counted.

    .venv/bin/python benchmarks/admission_calls.py

Two paths through the one request path every integration shares (`SchedulingService.admit`,
then the lease's end), on the memory:// scheduler with an in-flight limit:

- **no wait**: a slot is free, the request is admitted at once and its lease ends;
- **park, then grant**: the slot is held, the request parks (with a disconnect watch, as the
  integrations wait), the holder's lease ends, the parked request is granted and its lease ends.

Counted with `sys.setprofile`: every call into a Python function (the project's and the
standard library's, asyncio included; C functions are not counted), and "module switches":
calls whose callee is in a different module than its caller (a measure of back-and-forth).
Warm-up requests run first, so imports and first-time set-up are not counted.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from types import FrameType
from typing import Any

from fair_sched_plugin.identity import Credentials
from fair_sched_plugin.service import SchedulingService

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}


class CallCounter:
    def __init__(self) -> None:
        self.calls = 0
        self.switches = 0
        self.project_calls = 0
        self.by_module: Counter[str] = Counter()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        self.calls += 1
        module = frame.f_globals.get("__name__", "?")
        self.by_module[module] += 1
        if module.startswith("fair_sched_plugin"):
            self.project_calls += 1
        caller = frame.f_back
        if caller is not None and caller.f_globals.get("__name__", "?") != module:
            self.switches += 1


async def _measure() -> dict[str, CallCounter]:
    service = SchedulingService({"unknown_model_max_inflight": 1})
    principal = service.identify(Credentials(api_key="sk-a"))
    other = service.identify(Credentials(api_key="sk-b"))
    for _ in range(3):  # warm-up: both paths once, so nothing first-time is counted
        admission = await service.admit(principal, "m", BODY)
        waiting = asyncio.create_task(service.admit(other, "m", BODY, disconnected=asyncio.Event()))
        await asyncio.sleep(0)
        admission.lease.release()
        (await waiting).lease.release()
        await asyncio.sleep(0)

    results: dict[str, CallCounter] = {}
    counter = results["no wait"] = CallCounter()
    sys.setprofile(counter)
    admission = await service.admit(principal, "m", BODY)
    admission.lease.release()
    sys.setprofile(None)

    holder = await service.admit(principal, "m", BODY)
    counter = results["park, then grant"] = CallCounter()
    sys.setprofile(counter)
    waiting = asyncio.create_task(service.admit(other, "m", BODY, disconnected=asyncio.Event()))
    await asyncio.sleep(0)  # it parks
    holder.lease.release()  # the parked request is granted
    granted = await waiting
    granted.lease.release()
    sys.setprofile(None)
    await service.aclose()
    return results


def main() -> None:
    results = asyncio.run(_measure())
    print(f"{'path':>18} {'calls':>6} {'project calls':>14} {'module switches':>16}")
    for path, counter in results.items():
        print(f"{path:>18} {counter.calls:>6} {counter.project_calls:>14} {counter.switches:>16}")
    for path, counter in results.items():
        top = ", ".join(f"{m} {n}" for m, n in counter.by_module.most_common(8))
        print(f"{path}: {top}")


if __name__ == "__main__":
    main()
