"""What a request body costs `fair-sched proxy` with principal keys configured.

    .venv/bin/python benchmarks/body_cost.py [--stalled 30] [--parked 10000]
    .venv/bin/python benchmarks/body_cost.py --heap [--parked 2000] [--lines 40]
    .venv/bin/python benchmarks/body_cost.py --floor [--parked 10000]

Starts the engine emulator (one slot) and `fair-sched proxy` as child processes on 127.0.0.1
and measures, from the proxy's /proc status (`VmHWM` for peaks, `VmRSS` otherwise):

- an unknown key's 8 MiB body of ~2.8 million `{}` in `messages`: the time to its refusal, the
  slowest `/health` answer meanwhile, and the peak RSS growth; then the same body from a valid
  key (refused naming the limit);
- `--stalled` connections from unknown keys, each sending the headers of an 8 MiB upload and
  as much of its body as the server takes without the last byte: RSS growth and how many are
  closed, and when;
- in a fresh proxy, with the engine's slot held by two long streams (one runs, one waits), one
  parked request of ~8 MiB (a single message), then `--parked` small parked requests: RSS growth
  per request.

Prints one line per measure. Timings are wall-clock on whatever else the machine runs.

`--heap`: where a small parked request's Python heap goes, by file and line. The same set-up
for the last measure, with the proxy served in this process as `fair-sched proxy` serves it
(`proxy_server_config`) so that `tracemalloc` sees it, and the clients in a child process (this
script again) so that theirs are not counted. Prints the RSS growth per parked request (inflated
by tracemalloc's own bookkeeping: the RSS figure is the one above) and the traced growth per
parked request by file and by line (the line that allocated: a coroutine's frame is counted at
the line that called it).

`--floor`: what the HTTP server alone costs a parked request. uvicorn with `fair-sched proxy`'s
protocol, configured as the proxy configures it (read deadlines, no proxy-headers layer), whose
parking takes every POST in at the server (its body read, no app task) and keeps it: the same
small requests on their own connections, the RSS growth per request. What a parked request
costs the proxy beyond this is the scheduler's and the request path's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

HOST = "127.0.0.1"
MODEL = "tiny"
EIGHT_MIB = 8 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field}")


def engine_argv(port: int) -> list[str]:
    """The emulator with one slot."""
    return [sys.executable, "-m", "fair_sched_plugin.cli", "emulate", "--port", str(port),
            "--model", MODEL, "--max-num-seqs", "1", "--step-ms", "20"]  # fmt: skip


def proxy_config(engine_port: int, parked: int) -> dict[str, Any]:
    return {
        "fair_sched": {
            "tiers": [{"name": "interactive", "waiting_below": 1}],
            "principals": [{"name": "alice", "keys": ["sk-a"]}, {"name": "hog", "keys": ["sk-h"]}],
            "backends": {MODEL: {"api_base": f"http://{HOST}:{engine_port}/v1"}},
            "queue": {"max_per_user": parked + 10, "max_total": parked + 100},
            "metrics_poll_ms": 50,
        }
    }


def small_request() -> bytes:
    """A small non-streaming request from a known key, as sent on its own connection."""
    small = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    ).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer sk-a\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(small)}\r\n\r\n"
    ).encode() + small


def long_streams(client: httpx.AsyncClient) -> list[asyncio.Future[None]]:
    """Two long streams from another key: one holds the engine's slot, one waits."""
    hog_body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 100_000, "stream": True}  # fmt: skip

    async def hog() -> None:
        async with client.stream(
            "POST", "/v1/chat/completions", json=hog_body, timeout=600,
            headers={"authorization": "Bearer sk-h"},
        ) as response:  # fmt: skip
            async for _ in response.aiter_raw():
                pass

    return [asyncio.ensure_future(hog()) for _ in range(2)]


async def open_parked(port: int, parked: int) -> list[asyncio.StreamWriter]:
    """`parked` small requests, each on a connection of its own (left open)."""
    request = small_request()
    writers = []
    for index in range(parked):
        _reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(request)
        writers.append(writer)
        if index % 500 == 499:
            await asyncio.sleep(0.05)
    return writers


@contextlib.contextmanager
def servers(parked: int) -> Iterator[tuple[str, int]]:
    """The emulator and the proxy in front of it: (proxy base URL, proxy pid)."""
    engine_port, proxy_port = free_port(), free_port()
    python = sys.executable
    engine = subprocess.Popen(
        engine_argv(engine_port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
        json.dump(proxy_config(engine_port, parked), file)  # JSON is YAML
    proxy = subprocess.Popen(
        [python, "-m", "fair_sched_plugin.cli", "proxy", "--config", file.name,
         "--port", str(proxy_port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base_url = f"http://{HOST}:{proxy_port}"
    try:
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield base_url, proxy.pid
    finally:
        for process in (proxy, engine):
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            if process.poll() is None:
                process.kill()
        os.unlink(file.name)


def bomb() -> bytes:
    elements = (EIGHT_MIB - 64) // 3
    return b'{"model":"%s","messages":[%s]}' % (MODEL.encode(), b",".join([b"{}"] * elements))


def poll_health(base_url: str, done: Any, slowest: Any, answered: Any) -> None:
    with httpx.Client(base_url=base_url, trust_env=False, timeout=30) as client:
        while not done.is_set():
            started = time.perf_counter()
            client.get("/health")
            slowest.value = max(slowest.value, time.perf_counter() - started)
            answered.set()
            time.sleep(0.02)


async def refused(base_url: str, key: str, body: bytes) -> tuple[int, float, float, str]:
    """(status, seconds to the answer, slowest /health meanwhile, error message)."""
    # In a process of its own: this one's work (8 MiB to write) must not count.
    slowest = multiprocessing.Value("d", 0.0)
    answered = multiprocessing.Event()
    done = multiprocessing.Event()
    watcher = multiprocessing.Process(target=poll_health, args=(base_url, done, slowest, answered))
    watcher.start()
    await asyncio.get_running_loop().run_in_executor(None, answered.wait, 30)
    port = int(base_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection(HOST, port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    started = time.perf_counter()

    async def send_body() -> None:
        # A server that answers from the headers closes the connection while this still sends.
        with contextlib.suppress(ConnectionError):
            writer.write(head + body)
            await writer.drain()

    sending = asyncio.ensure_future(send_body())
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    took = time.perf_counter() - started
    length = int(re.search(rb"content-length: (\d+)", answer, re.I).group(1))  # type: ignore[union-attr]
    try:
        content = await reader.readexactly(length)
    except (ConnectionError, asyncio.IncompleteReadError):
        content = b"{}"  # reset by the server's close while the body was still coming
    writer.close()
    await sending
    done.set()
    watcher.join()
    message = json.loads(content).get("error", {}).get("message", "")
    return int(answer.split(b" ", 2)[1]), took, slowest.value, message


async def stalled_uploads(base_url: str, count: int, pid: int) -> None:
    port = int(base_url.rsplit(":", 1)[1])
    before = status_kib(pid, "VmRSS")
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer sk-x\r\n"
        f"Content-Type: application/json\r\nContent-Length: {EIGHT_MIB}\r\n\r\n"
    ).encode()
    started = time.perf_counter()
    closed_at: list[float] = []

    async def upload() -> None:
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(head)
        with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
            for _ in range(EIGHT_MIB // 65536 - 1):
                writer.write(b" " * 65536)
                await asyncio.wait_for(writer.drain(), 2)
        with contextlib.suppress(asyncio.TimeoutError):
            with contextlib.suppress(ConnectionError):
                while await asyncio.wait_for(reader.read(65536), 60):
                    pass
            closed_at.append(time.perf_counter() - started)
        writer.close()

    peak = before
    sampling = True

    def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, status_kib(pid, "VmRSS"))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    await asyncio.gather(*(upload() for _ in range(count)))
    sampling = False
    sampler.join()
    grown = (peak - before) / 1024
    last = max(closed_at) if closed_at else float("nan")
    print(
        f"{count} stalled 8 MiB uploads, unknown keys: {len(closed_at)} closed, the last after "
        f"{last:.2f} s; RSS at most +{grown:.1f} MiB (sampled every 5 ms)"
    )


async def parked_cost(base_url: str, pid: int, parked: int) -> None:
    port = int(base_url.rsplit(":", 1)[1])
    async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=600) as client:

        async def queued() -> int:
            text = (await client.get("/fair-sched/metrics")).text
            found = re.findall(r"^fair_sched_queued_requests\{[^}]*\} (\S+)", text, re.M)
            return int(sum(float(value) for value in found))

        async def until_queued(count: int) -> int:
            """How many are parked once `count` are, or once the count stops growing (a few
            may be refused or released on a loaded machine)."""
            last, steady = -1, 0
            for _ in range(3000):
                now = await queued()
                if now >= count or (now == last and now > 0 and (steady := steady + 1) >= 40):
                    return now
                if now != last:
                    last, steady = now, 0
                await asyncio.sleep(0.05)
            raise RuntimeError(f"only {await queued()} of {count} parked")

        # The gate on the engine's metrics (its start-up cap would let the next request in)...
        for _ in range(600):
            text = (await client.get("/fair-sched/metrics")).text
            if re.search(r'^fair_sched_gate_mode\{[^}]*mode="metrics"[^}]*\} 1', text, re.M):
                break
            await asyncio.sleep(0.05)
        hogs = long_streams(client)
        await asyncio.sleep(2)  # ...sees the engine's slot taken and its queue
        text = "x" * (EIGHT_MIB - 200)
        big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]})
        before = status_kib(pid, "VmRSS")
        heavy = asyncio.ensure_future(
            client.post(
                "/v1/chat/completions", content=big.encode(),
                headers={"authorization": "Bearer sk-a", "content-type": "application/json"},
            )
        )  # fmt: skip
        await until_queued(1)
        held = (status_kib(pid, "VmRSS") - before) / 1024
        print(f"one parked ~8 MiB request: RSS +{held:.1f} MiB")
        heavy.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await heavy
        await asyncio.sleep(1)

        before = status_kib(pid, "VmRSS")
        connections = await open_parked(port, parked)
        count = await until_queued(parked)
        held = (status_kib(pid, "VmRSS") - before) * 1024 / count
        print(f"{count} small parked requests: RSS +{held / 1024:.1f} KiB each (server side)")
        for writer in connections:
            writer.close()
        for task in hogs:
            task.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)


def floor_server(port: int) -> None:
    """`--floor`'s child: uvicorn with `fair-sched proxy`'s protocol, configured as the proxy
    configures it, whose parking takes in every POST (its body read by the protocol) and never
    lets it go; `GET /parked` (an app that answers at once) says how many are parked."""
    import uvicorn

    from fair_sched_plugin.request.proxy_protocol import proxy_protocol

    class ParkedForGood:
        __slots__ = ("body", "waiting")
        start_in_s = None

        def __init__(self, body: bytes) -> None:
            self.body = body
            self.waiting = asyncio.get_running_loop().create_future()

        def client_left(self) -> None:
            parked.remove(self)

    parked: list[ParkedForGood] = []

    class ParkEveryPost:
        def take(self, scope: dict[str, Any]) -> Any:
            if scope["method"] != "POST":
                return None

            def take_body(body: bytes) -> ParkedForGood:
                taken = ParkedForGood(body)
                parked.append(taken)
                return taken

            return take_body

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = str(len(parked)).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    config = uvicorn.Config(
        app, host=HOST, port=port, log_level="critical", lifespan="off", proxy_headers=False,
        http=proxy_protocol(
            headers_timeout_s=10.0, body_timeout_s=10.0, on_timeout=lambda phase: None,
            parking=ParkEveryPost(),
        ),
    )  # fmt: skip
    uvicorn.Server(config).run()


async def floor(parked: int) -> None:
    port = free_port()
    server = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--floor-server", str(port),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", trust_env=False) as client:

            async def count() -> int:
                return int((await client.get("/parked")).text)

            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    await count()
                    break
                await asyncio.sleep(0.1)
            before = status_kib(server.pid, "VmRSS")
            connections = await open_parked(port, parked)
            for _ in range(600):
                if await count() >= parked:
                    break
                await asyncio.sleep(0.05)
            held = (status_kib(server.pid, "VmRSS") - before) * 1024 / await count()
            print(
                f"{parked} small requests parked by the proxy's protocol alone (no queue, no "
                f"scheduler): RSS +{held / 1024:.1f} KiB each"
            )
            for writer in connections:
                writer.close()
    finally:
        server.kill()  # its parked requests never end: nothing to wait for
        await server.wait()


async def heap_clients(port: int, parked: int) -> None:
    """`--heap`'s child: the long streams, then (told on stdin) the parked requests, then (told
    again) closes them all."""
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", trust_env=False) as client:
        hogs = long_streams(client)
        print("streams", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        writers = await open_parked(port, parked)
        print("sent", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        for writer in writers:
            writer.close()
        for task in hogs:
            task.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)


def shown(filename: str) -> str:
    return filename.split("site-packages/")[-1].replace(os.getcwd() + "/", "")


async def heap(parked: int, lines: int) -> None:
    import uvicorn

    from fair_sched_plugin.proxy import build_proxy_app, proxy_server_config

    engine_port, proxy_port = free_port(), free_port()
    engine = await asyncio.create_subprocess_exec(
        *engine_argv(engine_port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        async with httpx.AsyncClient(trust_env=False) as probe:
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await probe.get(f"http://{HOST}:{engine_port}/health")).is_success:
                        break
                await asyncio.sleep(0.1)
        app = build_proxy_app(proxy_config(engine_port, parked))
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
        before, rss_before = tracemalloc.take_snapshot(), status_kib(os.getpid(), "VmRSS")
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
        after, rss_after = tracemalloc.take_snapshot(), status_kib(os.getpid(), "VmRSS")
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


async def main(args: argparse.Namespace) -> None:
    with servers(args.parked) as (base_url, pid):
        body = bomb()
        before = status_kib(pid, "VmHWM")
        status, took, slowest, _ = await refused(base_url, "sk-unknown", body)
        grown = (status_kib(pid, "VmHWM") - before) / 1024
        print(
            f"unknown key, 8 MiB of {body.count(b'{}')} elements: {status} after {took:.3f} s; "
            f"slowest /health {slowest:.3f} s; peak RSS +{grown:.1f} MiB"
        )
        before = status_kib(pid, "VmHWM")
        status, took, slowest, message = await refused(base_url, "sk-a", body)
        grown = (status_kib(pid, "VmHWM") - before) / 1024
        print(
            f"valid key, same body: {status} after {took:.3f} s ({message!r}); slowest /health "
            f"{slowest:.3f} s; peak RSS +{grown:.1f} MiB"
        )
        await stalled_uploads(base_url, args.stalled, pid)
    # A fresh proxy: memory the bodies above left free would otherwise hide what parking costs.
    with servers(args.parked) as (base_url, pid):
        await parked_cost(base_url, pid, args.parked)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stalled", type=int, default=30)
    parser.add_argument("--parked", type=int, default=None, help="10,000; with --heap 2,000")
    parser.add_argument("--heap", action="store_true", help="the parked requests' heap by file")
    parser.add_argument("--lines", type=int, default=40, help="with --heap: rows per table")
    parser.add_argument("--floor", action="store_true", help="uvicorn's own cost of a parked one")
    parser.add_argument("--clients", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--floor-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_server is not None:
        floor_server(args.floor_server)
    elif args.floor:
        asyncio.run(floor(args.parked or 10_000))
    elif args.clients is not None:
        asyncio.run(heap_clients(args.clients, args.parked))
    elif args.heap:
        asyncio.run(heap(args.parked or 2000, args.lines))
    else:
        args.parked = args.parked or 10_000
        asyncio.run(main(args))
