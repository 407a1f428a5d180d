"""How much code one request's admission runs: Python calls and module switches, counted.

    .venv/bin/python benchmarks/admission_calls.py

(the benchmark prints what `measure` counts; a test holds the bounds)

Two paths through the one request path every integration shares (`SchedulingService.admit`,
then the lease's end), on the memory:// scheduler with an in-flight limit:

- **no wait**: a slot is free, the request is admitted at once and its lease ends;
- **park, then grant**: the slot is held, the request parks (with a disconnect watch, as the
  integrations wait: their `DisconnectSignal`), the holder's lease ends, the parked request is
  granted and its lease ends.

and, where the `litellm` extra is installed, one request through the wrapping a LiteLLM proxy's
app gets (`install_request_watch`, around a stub app that does what the pre-call hook does with
the request's watch: admit, hold the lease, answer):

- **LiteLLM, hook-scheduled**: `POST /v1/chat/completions`, from the server's call of the proxy
  app to the lease's end (the middleware's routing and header scan, the request's watch, the
  admission, the response and the end). Also printed: the regex searches and header scans it
  made (C calls, seen by the profiler; header scans counted by the scope's header list).

Counted with `sys.setprofile`: every call into a Python function (the project's and the
standard library's, asyncio included; C functions are not counted), and "module switches":
calls whose callee is in a different module than its caller (a measure of back-and-forth).
Warm-up requests run first, so imports and first-time set-up are not counted.
"""

from __future__ import annotations

import asyncio
import gc
import re
import sys
from collections import Counter
from types import FrameType
from typing import Any

from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.request.watch import current_request
from fair_sched_plugin.runtime.driver import DisconnectSignal
from fair_sched_plugin.runtime.service import SchedulingService

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}


class CallCounter:
    def __init__(self) -> None:
        self.calls = 0
        self.switches = 0
        self.project_calls = 0
        self.by_module: Counter[str] = Counter()
        self.header_scans = 0

        self.regex_searches = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and isinstance(getattr(arg, "__self__", None), re.Pattern):
            self.regex_searches += 1
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


def pause_collector() -> bool:
    """Collect, then pause the cyclic collector while a path is counted; returns whether it was
    on. A collection frees whatever earlier work left behind (a dead task calls back into
    asyncio's set of tasks): not the admission's code, and it made the counts depend on what the
    process had run before (139 calls / 86 switches on a CI test worker for 129 / 78 here).
    Paused and resumed outside the profiled region, so the counts hold nothing of it."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    return collecting


def resume_collector(collecting: bool) -> None:
    if collecting:
        gc.enable()


async def measure(with_litellm: bool = True) -> dict[str, CallCounter]:
    """Each path's counts; the LiteLLM path too where asked and the extra is installed."""
    service = SchedulingService({"unknown_model_max_inflight": 1})
    principal = service.identify(Credentials(api_key="sk-a"))
    other = service.identify(Credentials(api_key="sk-b"))
    for _ in range(3):  # warm-up: both paths once, so nothing first-time is counted
        admission = await service.admit(principal, "m", BODY)
        waiting = asyncio.create_task(
            service.admit(other, "m", BODY, disconnected=DisconnectSignal())
        )
        await asyncio.sleep(0)
        admission.lease.release()
        (await waiting).lease.release()
        await asyncio.sleep(0)

    results: dict[str, CallCounter] = {}
    counter = results["no wait"] = CallCounter()
    collecting = pause_collector()
    sys.setprofile(counter)
    admission = await service.admit(principal, "m", BODY)
    admission.lease.release()
    sys.setprofile(None)
    resume_collector(collecting)

    holder = await service.admit(principal, "m", BODY)
    counter = results["park, then grant"] = CallCounter()
    collecting = pause_collector()
    sys.setprofile(counter)
    waiting = asyncio.create_task(service.admit(other, "m", BODY, disconnected=DisconnectSignal()))
    await asyncio.sleep(0)  # it parks
    holder.lease.release()  # the parked request is granted
    granted = await waiting
    granted.lease.release()
    sys.setprofile(None)
    resume_collector(collecting)
    await service.aclose()
    if with_litellm and _has_litellm():
        results["LiteLLM, hook-scheduled"] = await _litellm_request()
    return results


def _has_litellm() -> bool:
    import importlib.util

    return importlib.util.find_spec("litellm") is not None


class CountingHeaders(list[tuple[bytes, bytes]]):
    """A scope's header list that counts how often it is walked."""

    scans = 0

    def __iter__(self) -> Any:
        CountingHeaders.scans += 1
        return super().__iter__()


async def _litellm_request() -> CallCounter:
    from types import SimpleNamespace

    from fair_sched_plugin.litellm._proxy import install_request_watch

    service = SchedulingService({"unknown_model_max_inflight": 1})
    principal = service.identify(Credentials(api_key="sk-a"))

    async def hook_app(scope: Any, receive: Any, send: Any) -> None:
        """What LiteLLM's app and our pre-call hook do with the request's watch."""
        await receive()  # LiteLLM reads the body
        request = current_request()
        assert request is not None
        admission = await service.admit(
            principal,
            "m",
            BODY,
            disconnected=request.watch(),
            waiting=request,
            max_wait_s=request.max_wait_s(service.settings.queue.max_wait_s),
        )
        request.hold(admission.lease)
        request.forwarded()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    proxy_server = SimpleNamespace(app=SimpleNamespace(middleware_stack=hook_app))
    install_request_watch(proxy_server, service)
    app = proxy_server.app.middleware_stack

    async def one_request(counter: CallCounter | None) -> None:
        sent = asyncio.Event()

        async def receive() -> Any:
            if not sent.is_set():
                sent.set()
                return {"type": "http.request", "body": b"{}", "more_body": False}
            await asyncio.Event().wait()  # the client stays

        async def send(message: Any) -> None:
            pass

        headers = CountingHeaders(
            [(b"host", b"127.0.0.1"), (b"authorization", b"Bearer sk-a"), (b"accept", b"*/*")]
        )
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": headers,
            "state": {},
        }
        CountingHeaders.scans = 0
        collecting = pause_collector()
        if counter is not None:
            sys.setprofile(counter)
        await app(scope, receive, send)
        sys.setprofile(None)
        resume_collector(collecting)
        if counter is not None:
            counter.header_scans = CountingHeaders.scans

    for _ in range(3):
        await one_request(None)
    counter = CallCounter()
    await one_request(counter)
    await service.aclose()
    return counter


def main() -> None:
    results = asyncio.run(measure())
    print(f"{'path':>24} {'calls':>6} {'project calls':>14} {'module switches':>16}")
    for path, counter in results.items():
        print(f"{path:>24} {counter.calls:>6} {counter.project_calls:>14} {counter.switches:>16}")
    litellm = results.get("LiteLLM, hook-scheduled")
    if litellm is not None:
        print(
            f"LiteLLM, hook-scheduled: {litellm.regex_searches} regex searches, "
            f"{litellm.header_scans} header scans"
        )
    for path, counter in results.items():
        top = ", ".join(f"{m} {n}" for m, n in counter.by_module.most_common(8))
        print(f"{path}: {top}")


if __name__ == "__main__":
    main()
