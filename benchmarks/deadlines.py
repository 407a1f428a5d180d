"""Deadlines through `fair-sched proxy`: who is refused at once, who starts in time, who misses.

    .venv/bin/python benchmarks/deadlines.py [--flood 100] [--batch 40] [--light-users 3]

One 8-slot emulator engine behind the standalone fair proxy (one tier, round robin). At 0 s a
flood user sends `--flood` streaming requests with no limit of its own. At `--batch-at` seconds
(after the drain rate has been measured: nothing is refused early before) a batch user sends
`--batch` at once with `x-fair-sched-max-wait-s: 2`, and light users send one request each every
`--light-every` seconds with a 1 s limit, `--light-requests` each.

A request "starts" when the scheduler releases it: the proxy's `x-fair-sched-queued-s` response
header says how long it waited for that (its response headers, which also wait for the engine's
own queue and first step, are printed for the light users). The flood's requests ask for 32 to
96 tokens, so the engine's slots do not all free at once. Printed: per group the answers by status
and error code; of the requests with a limit, how many were refused at once (429
`deadline_unreachable`; how long they had waited in the proxy, its `x-fair-sched-queued-s`, and
their answer time as the client saw it, at p50/p95), how many started in time, started after
their limit, or were refused after waiting it out (504); whether the flood was served whole;
and the proxy's own per-tier deadline counts from `/fair-sched/status`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from fair_sched_plugin.lab.loadtest.processes import (
    MASTER_KEY,
    EmulatorSettings,
    emulator_process,
    fair_proxy,
)

ENGINE = EmulatorSettings(max_num_seqs=8, policy="fcfs", step_ms=12.0, step_ms_per_seq=0.5)
FLOOD_KEY = "sk-deadlines-flood-7d1e"
BATCH_KEY = "sk-deadlines-batch-2f9a"
LIGHT_KEY_PREFIX = "sk-deadlines-light-"
BATCH_LIMIT_S = 2.0
LIGHT_LIMIT_S = 1.0
MIN_TOKENS = 32
MAX_TOKENS = 96
# Every request is bounded: the longest any may take, engine time included.
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Scenario:
    flood: int = 100
    batch: int = 40
    batch_at_s: float = 2.0
    light_users: int = 3
    light_requests: int = 5
    light_every_s: float = 0.7
    # When the light users' first round goes: before the batch (they are about; the default),
    # or with it (`--light-at` = `--batch-at`: nobody can foresee them when the batch arrives).
    light_at_s: float = 0.6


@dataclass
class Outcome:
    group: str
    limit_s: float | None
    status: int = 0
    code: str | None = None
    answered_s: float = 0.0  # from sending to the response headers
    error: str | None = None
    queued_s: float | None = None  # the proxy's `x-fair-sched-queued-s`: its wait for a turn

    @property
    def started(self) -> bool:
        return self.status == 200

    @property
    def started_late(self) -> bool:
        return (
            self.started
            and self.limit_s is not None
            and (self.queued_s is None or self.queued_s > self.limit_s)
        )

    @property
    def refused_at_once(self) -> bool:
        return self.status == 429 and self.code == "deadline_unreachable"


def settings(engine_base: str, scenario: Scenario) -> dict[str, Any]:
    principals = [
        {"name": "flood", "keys": [FLOOD_KEY]},
        {"name": "batch", "keys": [BATCH_KEY]},
    ]
    principals += [
        {"name": f"light-{n}", "keys": [f"{LIGHT_KEY_PREFIX}{n}-0000"]}
        for n in range(scenario.light_users)
    ]
    return {
        "tiers": [{"name": "interactive", "waiting_below": 1}],
        "default_tier": "interactive",
        "principals": principals,
        "backends": {
            "tiny": {
                "api_base": f"{engine_base}/v1",
                "metrics_url": f"{engine_base}/metrics",
                "engine": "vllm",
            }
        },
        "queue": {"max_per_user": 5000, "max_total": 20000, "max_wait_s": 300},
        "metrics_poll_ms": 50,
        "observability": {"admin_key": MASTER_KEY},
    }


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
    }


def max_tokens_for(n: int) -> int:
    """The `n`-th request's length in a group: spread over [MIN_TOKENS, MAX_TOKENS]."""
    return MIN_TOKENS + (n * 37) % (MAX_TOKENS - MIN_TOKENS + 1)


async def one_request(
    client: httpx.AsyncClient, key: str, outcome: Outcome, *, prompt: str, max_tokens: int
) -> Outcome:
    headers = {"authorization": f"Bearer {key}"}
    if outcome.limit_s is not None:
        headers["x-fair-sched-max-wait-s"] = f"{outcome.limit_s:g}"
    body = chat_body(prompt, max_tokens)
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/chat/completions", json=body, headers=headers) as resp:
            outcome.answered_s = time.perf_counter() - sent
            outcome.status = resp.status_code
            queued = resp.headers.get("x-fair-sched-queued-s")
            outcome.queued_s = float(queued) if queued is not None else None
            if resp.status_code != 200:
                await resp.aread()
                outcome.code = resp.json().get("error", {}).get("code")
            else:
                async for _ in resp.aiter_bytes():
                    pass
    except httpx.HTTPError as exc:
        outcome.error = type(exc).__name__
    return outcome


def raw_request(
    host: str, path: str, key: str, limit_s: float, prompt: str, max_tokens: int
) -> bytes:
    body = json.dumps(chat_body(prompt, max_tokens)).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
        f"x-fair-sched-max-wait-s: {limit_s:g}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def error_code(headers: dict[str, str], rest: bytes) -> str | None:
    """The `error.code` of a JSON error body, read whole up to the connection's close."""
    if headers.get("transfer-encoding") == "chunked":
        body, chunks = b"", rest
        while chunks:
            size_line, _, chunks = chunks.partition(b"\r\n")
            size = int(size_line, 16)
            body, chunks = body + chunks[:size], chunks[size + 2 :]
        rest = body
    try:
        code = json.loads(rest).get("error", {}).get("code")
    except ValueError:
        return None
    return code if isinstance(code, str) else None


async def raw_one(host: str, port: int, request: bytes) -> dict[str, Any]:
    """One request on a new connection: the time to its response's head, its status, its wait
    (`x-fair-sched-queued-s`) and error code; the rest is read to the connection's close."""
    sent = time.perf_counter()
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        answered_s = time.perf_counter() - sent
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines if line)
        }
        rest = await reader.read()
        status = int(status_line.split()[1])
        return {
            "status": status,
            "answered_s": answered_s,
            "queued_s": headers.get("x-fair-sched-queued-s"),
            "code": error_code(headers, rest) if status != 200 else None,
        }
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        return {"status": 0, "answered_s": time.perf_counter() - sent, "error": type(exc).__name__}
    finally:
        if writer is not None:
            writer.close()


async def burst_client(spec: dict[str, Any]) -> None:
    """The batch user's burst, from a process of its own with pre-built requests on raw sockets:
    sending 40 at once through the benchmark's httpx client, whose loop also reads the flood's
    streams, timed the client (tens of ms) as much as the proxy's decision. Fires on a line on
    stdin; prints one JSON list."""
    requests = [raw_request(**fields) for fields in spec["requests"]]
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    one = [raw_one(spec["host"], spec["port"], request) for request in requests]
    results = await asyncio.wait_for(asyncio.gather(*one), REQUEST_TIMEOUT_S)
    print(json.dumps(results), flush=True)


class Burst:
    """The burst client's process: started ahead, fired at the batch's time."""

    def __init__(self, base_url: str, key: str, limit_s: float, count: int) -> None:
        url = urlsplit(base_url)
        assert url.hostname is not None and url.port is not None
        self.spec = {
            "host": url.hostname,
            "port": url.port,
            "requests": [
                {
                    "host": f"{url.hostname}:{url.port}",
                    "path": f"{url.path}/chat/completions",
                    "key": key,
                    "limit_s": limit_s,
                    "prompt": f"batch {n}",
                    "max_tokens": max_tokens_for(n),
                }
                for n in range(count)
            ],
        }
        self.limit_s = limit_s
        self.process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Burst:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--burst-client",
            json.dumps(self.spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.process.stdout is not None
        ready = await asyncio.wait_for(self.process.stdout.readline(), 30.0)
        assert ready == b"ready\n", ready
        return self

    def fire(self) -> None:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(b"go\n")

    async def outcomes(self) -> list[Outcome]:
        assert self.process is not None and self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), REQUEST_TIMEOUT_S + 10)
        results = json.loads(line)
        return [
            Outcome(
                "batch",
                self.limit_s,
                status=result["status"],
                code=result.get("code"),
                answered_s=result["answered_s"],
                error=result.get("error"),
                queued_s=float(result["queued_s"]) if result.get("queued_s") else None,
            )
            for result in results
        ]

    async def __aexit__(self, *exc: object) -> None:
        assert self.process is not None
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()


async def play(base_url: str, scenario: Scenario) -> list[Outcome]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with (
        httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client,
        Burst(base_url, BATCH_KEY, BATCH_LIMIT_S, scenario.batch) as burst,
    ):
        tasks: list[asyncio.Task[Outcome]] = []

        def send(key: str, group: str, limit_s: float | None, n: int) -> None:
            outcome = Outcome(group, limit_s)
            request = one_request(
                client, key, outcome, prompt=f"{group} {n}", max_tokens=max_tokens_for(n)
            )
            tasks.append(asyncio.create_task(request))

        async def light_users() -> None:
            await asyncio.sleep(scenario.light_at_s)
            for round_ in range(scenario.light_requests):
                for user in range(scenario.light_users):
                    key = f"{LIGHT_KEY_PREFIX}{user}-0000"
                    send(key, "light", LIGHT_LIMIT_S, round_ * scenario.light_users + user)
                await asyncio.sleep(scenario.light_every_s)

        for n in range(scenario.flood):
            send(FLOOD_KEY, "flood", None, n)
        light = asyncio.create_task(light_users())
        await asyncio.sleep(scenario.batch_at_s)
        burst.fire()
        await light
        return [*await asyncio.gather(*tasks), *await burst.outcomes()]


async def proxy_deadline_counts(base_url: str) -> dict[str, Any]:
    root = base_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.get(
            f"{root}/fair-sched/status", headers={"authorization": f"Bearer {MASTER_KEY}"}
        )
        response.raise_for_status()
        return {tier["name"]: tier.get("deadlines") for tier in response.json()["tiers"]}


async def run(scenario: Scenario) -> tuple[list[Outcome], dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="fair-sched-deadlines-") as workdir:
        async with emulator_process(ENGINE) as engine:
            section = settings(engine.base_url, scenario)
            async with fair_proxy(section, Path(workdir), "deadlines") as proxy:
                outcomes = await play(proxy.base_url, scenario)
                counts = await proxy_deadline_counts(proxy.base_url)
    return outcomes, counts


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    """The numbers the scenario is judged by."""
    limited = [o for o in outcomes if o.limit_s is not None]
    refused = [o for o in limited if o.refused_at_once]
    started = [o for o in limited if o.started]
    late = [o for o in started if o.started_late]
    waited_out = [o for o in limited if o.status == 504]
    light = [o for o in outcomes if o.group == "light"]
    flood = [o for o in outcomes if o.group == "flood"]
    refusal_times = [o.answered_s for o in refused]
    refusal_waits = [o.queued_s for o in refused if o.queued_s is not None]
    return {
        "limited": len(limited),
        "refused_at_once": len(refused),
        "refusal_p50_s": statistics.median(refusal_times) if refusal_times else None,
        "refusal_p95_s": percentile(refusal_times, 0.95) if refusal_times else None,
        "refusal_wait_p50_s": statistics.median(refusal_waits) if refusal_waits else None,
        "refusal_wait_p95_s": percentile(refusal_waits, 0.95) if refusal_waits else None,
        "refused_after_limit": sum(
            o.queued_s is None or o.limit_s is None or o.queued_s >= o.limit_s for o in refused
        ),
        "started_in_time": len(started) - len(late),
        "started_late": len(late),
        "late_share": len(late) / len(limited) if limited else 0.0,
        "waited_out_504": len(waited_out),
        "light_in_time": sum(o.started and not o.started_late for o in light),
        "light_headers_p95_s": percentile([o.answered_s for o in light], 0.95) if light else None,
        "light": len(light),
        "flood_served": sum(o.started for o in flood),
        "flood": len(flood),
        "batch_started": sum(o.started for o in outcomes if o.group == "batch"),
        "errors": Counter(o.error for o in outcomes if o.error),
    }


def report(outcomes: list[Outcome], counts: dict[str, Any]) -> None:
    for group in ("flood", "batch", "light"):
        answers = Counter(
            f"{o.status}{' ' + o.code if o.code else ''}" for o in outcomes if o.group == group
        )
        print(f"{group:>6}: {dict(sorted(answers.items()))}")
    numbers = summary(outcomes)
    print(f"with a limit: {numbers['limited']}; refused at once {numbers['refused_at_once']}")
    if numbers["refused_at_once"]:
        print(
            f"  waited in the proxy {numbers['refusal_wait_p50_s']:.3f} s p50, "
            f"{numbers['refusal_wait_p95_s']:.3f} s p95 (after their limit: "
            f"{numbers['refused_after_limit']}); answered to the client in "
            f"{numbers['refusal_p50_s']:.3f} s p50, {numbers['refusal_p95_s']:.3f} s p95"
        )
    print(
        f"started in time {numbers['started_in_time']}, started after their limit "
        f"{numbers['started_late']} ({100 * numbers['late_share']:.1f} %), refused after waiting "
        f"their limit out (504) {numbers['waited_out_504']}"
    )
    print(
        f"light users in time: {numbers['light_in_time']} of {numbers['light']} (their "
        f"response headers at p95: {numbers['light_headers_p95_s']:.3f} s)"
    )
    print(f"flood served: {numbers['flood_served']} of {numbers['flood']}")
    if numbers["errors"]:
        print(f"transport errors: {dict(numbers['errors'])}")
    print(f"the proxy's deadline counts per tier: {counts}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--burst-client"]:
        asyncio.run(burst_client(json.loads(argv[1])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=Scenario.flood)
    parser.add_argument("--batch", type=int, default=Scenario.batch)
    parser.add_argument("--batch-at", type=float, default=Scenario.batch_at_s)
    parser.add_argument("--light-users", type=int, default=Scenario.light_users)
    parser.add_argument("--light-requests", type=int, default=Scenario.light_requests)
    parser.add_argument("--light-every", type=float, default=Scenario.light_every_s)
    parser.add_argument("--light-at", type=float, default=Scenario.light_at_s)
    args = parser.parse_args(argv)
    scenario = Scenario(
        args.flood,
        args.batch,
        args.batch_at,
        args.light_users,
        args.light_requests,
        args.light_every,
        args.light_at,
    )
    outcomes, counts = asyncio.run(run(scenario))
    report(outcomes, counts)


if __name__ == "__main__":
    main()
