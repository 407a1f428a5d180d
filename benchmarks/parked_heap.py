"""Where a small parked request's Python heap goes in `fair-sched proxy`, by file and line.

    .venv/bin/python benchmarks/parked_heap.py [--parked 2000] [--lines 40]

`benchmarks/body_cost.py`'s set-up for its last measure (principal keys, the engine emulator
with one slot held by two long streams, small non-streaming requests parked behind them), with
the proxy served in this process as `fair-sched proxy` serves it (`proxy_server_config`) so that
`tracemalloc` sees it; the clients run in a child process (this script again, `--clients`), so
their allocations are not counted. Prints the proxy's RSS growth per parked request (inflated
by tracemalloc's own bookkeeping: `body_cost.py` measures RSS), then the traced growth per
parked request by file and by line (the line that allocated: a coroutine's frame is counted at
the line that called it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import httpx
import uvicorn

from fair_sched_plugin.proxy import build_proxy_app, proxy_server_config

HOST = "127.0.0.1"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def clients(port: int, parked: int) -> None:
    """Two long streams (`hogs`), then, told to on stdin, `parked` small requests on as many
    connections; closes them all when told again."""
    loop = asyncio.get_running_loop()
    hog_body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 100_000, "stream": True}  # fmt: skip
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", trust_env=False) as client:

        async def hog() -> None:
            async with client.stream(
                "POST", "/v1/chat/completions", json=hog_body, timeout=600,
                headers={"authorization": "Bearer sk-h"},
            ) as response:  # fmt: skip
                async for _ in response.aiter_raw():
                    pass

        hogs = [asyncio.ensure_future(hog()) for _ in range(2)]
        print("hogs", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        small = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
        ).encode()
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer sk-a\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(small)}\r\n\r\n"
        ).encode() + small
        writers = []
        for index in range(parked):
            _reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(request)
            writers.append(writer)
            if index % 500 == 499:
                await asyncio.sleep(0.05)
        print("sent", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        for writer in writers:
            writer.close()
        for task in hogs:
            task.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)


def shown(filename: str) -> str:
    return filename.split("site-packages/")[-1].replace(os.getcwd() + "/", "")


async def profile(parked: int, lines: int) -> None:
    engine_port, proxy_port = free_port(), free_port()
    engine = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fair_sched_plugin.cli", "emulate", "--port", str(engine_port),
        "--model", MODEL, "--max-num-seqs", "1", "--step-ms", "20",
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    config = {
        "fair_sched": {
            "tiers": [{"name": "interactive", "waiting_below": 1}],
            "principals": [{"name": "alice", "keys": ["sk-a"]}, {"name": "hog", "keys": ["sk-h"]}],
            "backends": {MODEL: {"api_base": f"http://{HOST}:{engine_port}/v1"}},
            "queue": {"max_per_user": parked + 10, "max_total": parked + 100},
            "metrics_poll_ms": 50,
        }
    }
    try:
        async with httpx.AsyncClient(trust_env=False) as probe:
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await probe.get(f"http://{HOST}:{engine_port}/health")).is_success:
                        break
                await asyncio.sleep(0.1)
        app = build_proxy_app(config)
        service = app.state.fair_sched
        server = uvicorn.Server(
            proxy_server_config(app, host=HOST, port=proxy_port, log_level="warning")
        )
        serving = asyncio.ensure_future(server.serve())
        for _ in range(600):
            if server.started:
                break
            await asyncio.sleep(0.05)
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--clients", str(proxy_port), "--parked", str(parked),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert child.stdin is not None and child.stdout is not None
        await child.stdout.readline()
        await asyncio.sleep(3)  # the gate sees the engine's slot taken and its queue
        tracemalloc.start()
        gc.collect()
        before, rss_before = tracemalloc.take_snapshot(), rss_kib()
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        await child.stdout.readline()
        last, steady, deadline = -1, 0, time.monotonic() + 150
        while time.monotonic() < deadline:
            queued = service.scheduler.statistics().queued
            if queued >= parked or (queued == last and queued > 0 and (steady := steady + 1) > 40):
                break
            if queued != last:
                last, steady = queued, 0
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        count = service.scheduler.statistics().queued
        gc.collect()
        after, rss_after = tracemalloc.take_snapshot(), rss_kib()
        tracemalloc.stop()
        ignored = [tracemalloc.Filter(False, tracemalloc.__file__)]
        before, after = before.filter_traces(ignored), after.filter_traces(ignored)
        by_file = after.compare_to(before, "filename")
        total = sum(stat.size_diff for stat in by_file)
        print(
            f"{count} parked: RSS +{(rss_after - rss_before) / count:.1f} KiB each (under "
            f"tracemalloc), traced +{total / count:.0f} B each"
        )
        print("by file (bytes and objects per parked request):")
        for stat in by_file[:lines]:
            print(
                f"{stat.size_diff / count:8.0f} B {stat.count_diff / count:6.2f}  "
                f"{shown(stat.traceback[0].filename)}"
            )
        print("by line:")
        for stat in after.compare_to(before, "lineno")[:lines]:
            frame = stat.traceback[0]
            print(
                f"{stat.size_diff / count:8.0f} B {stat.count_diff / count:6.2f}  "
                f"{shown(frame.filename)}:{frame.lineno}"
            )
        child.stdin.write(b"done\n")
        await child.stdin.drain()
        await child.wait()
        server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(serving, 10)
    finally:
        engine.terminate()
        await asyncio.wait_for(engine.wait(), 10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parked", type=int, default=2000)
    parser.add_argument("--lines", type=int, default=40)
    parser.add_argument("--clients", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.clients is not None:
        asyncio.run(clients(args.clients, args.parked))
    else:
        asyncio.run(profile(args.parked, args.lines))
