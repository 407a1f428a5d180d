"""Where a light request's time to first token goes, idle and under a same-tier flood.

    python benchmarks/ttft_breakdown.py [--policy fcfs|priority] [--reserve-slots N] [--flood 100]
                                     [--engine URL]

An emulator in this process (8 slots, the demo's engine) behind a real LiteLLM proxy with the
plugin (the demo's settings, every user in one tier). First the two light users alone on the idle
engine (three rounds), then the demo's flood: 100 streaming requests at once, the two light
requests one second later. Every light request is split, from the client's clock and the
engine's own timestamps of that request, into

- parked in the plugin: what its `x-fair-sched-queued-s` response header says;
- intake and relay: the rest of the way from the client's send to the engine (LiteLLM's intake,
  authentication and the plugin's hook, the relay);
- in the engine's queue: until every request ahead of it in the engine's queue was admitted;
- for a slot: from then until the engine admitted it into a running slot;
- prefill: from its admission to its first token (the engine's step);
- back to the client: the first token's way back through the proxy.

The light requests are told apart by their prompt (a few characters longer than the flood's).
With `--engine` (a real engine started with `--max-num-seqs 8`; `--policy priority` where it was
started with priority scheduling) the engine gives no per-request timestamps: only the time
parked in the plugin and the rest are split.
Prints a Markdown table of medians and the throughput of the flood.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from fair_sched_plugin.lab.emulator.engine import EmulatorConfig
from fair_sched_plugin.lab.emulator.server import run_emulator
from fair_sched_plugin.lab.loadtest.client import (
    PROMPT,
    Caller,
    completion_body,
    make_client,
    stream_one,
)
from fair_sched_plugin.lab.loadtest.client import _has_content as has_content
from fair_sched_plugin.lab.loadtest.flood import LIGHT_KEYS, POWER_KEY, Variant, fair_sched_section
from fair_sched_plugin.lab.loadtest.processes import litellm_config, litellm_proxy
from fair_sched_plugin.runtime.engine_http import sse_lines

LIGHT_PROMPT = PROMPT + " Keep it very short, please."
MAX_TOKENS = 64
IDLE_ROUNDS = 3


class Seen(NamedTuple):
    """A request as the engine saw it (monotonic seconds: one clock across processes)."""

    prompt_tokens: int
    arrival_order: int
    arrived_at: float
    admitted_at: float | None
    first_token_at: float | None


def _engine_process(policy: str, ready: Any, commands: Any) -> None:
    """The emulator in a process of its own (as the demo runs it), recording every request;
    answers "take" with the requests seen since the last "take", stops on "stop"."""

    async def serve() -> None:
        config = EmulatorConfig(
            models=("tiny",),
            max_num_seqs=8,
            policy=policy,  # type: ignore[arg-type]
            base_step_ms=12.0,
            step_ms_per_running_seq=0.5,
        )
        async with run_emulator(config) as emulator:
            seen: list[Any] = []
            submit = emulator.engine.submit

            def recording_submit(*a: Any, **k: Any) -> Any:
                seq = submit(*a, **k)
                seen.append(seq)
                return seq

            emulator.engine.submit = recording_submit  # type: ignore[method-assign]
            ready.send(emulator.base_url)
            loop = asyncio.get_running_loop()
            while await loop.run_in_executor(None, commands.recv) != "stop":
                ready.send(
                    [
                        Seen(
                            s.prompt_tokens,
                            s.arrival_order,
                            s.arrived_at,
                            s.admitted_at,
                            s.first_token_at,
                        )
                        for s in seen
                    ]
                )
                seen.clear()

    asyncio.run(serve())


async def _light(client: Any, base: str, index: int) -> tuple[float, float | None, float]:
    """One light request: sent at, first token at (the monotonic clock), and how long the
    plugin held it in its queue (its `x-fair-sched-queued-s` response header)."""
    headers = {"authorization": f"Bearer {LIGHT_KEYS[index]}"}
    body = completion_body(MAX_TOKENS, [{"role": "user", "content": LIGHT_PROMPT}])
    sent, first, queued = time.monotonic(), None, 0.0
    async with client.stream(
        "POST", f"{base}/chat/completions", json=body, headers=headers
    ) as response:
        queued = float(response.headers.get("x-fair-sched-queued-s", "0"))
        async for line in sse_lines(response.aiter_text()):
            if first is None and has_content(line):
                first = time.monotonic()
    return sent, first, queued


def _parts(
    sent: float, first: float | None, queued: float, seq: Seen | None, seen: list[Seen]
) -> dict[str, float]:
    assert first is not None
    if seq is None:
        # A real engine: no timestamps of its own per request, only the client's and ours.
        return {
            "parked in the plugin": queued,
            "the rest": first - sent - queued,
            "TTFT": first - sent,
        }
    assert seq.admitted_at is not None and seq.first_token_at is not None and first is not None
    # Ahead of it in the engine's queue: earlier (or more urgent) requests admitted after it came.
    ahead = [
        other.admitted_at
        for other in seen
        if other is not seq
        and other.admitted_at is not None
        and seq.arrived_at <= other.admitted_at <= seq.admitted_at
        and other.arrival_order < seq.arrival_order
        and other.arrived_at <= seq.arrived_at
    ]
    queue_done = max(ahead, default=seq.arrived_at)
    return {
        "parked in the plugin": queued,
        "intake and relay": seq.arrived_at - sent - queued,
        "in the engine's queue": queue_done - seq.arrived_at,
        "for a slot": seq.admitted_at - queue_done,
        "prefill": seq.first_token_at - seq.admitted_at,
        "back to the client": first - seq.first_token_at,
        "TTFT": first - sent,
    }


async def main(args: argparse.Namespace) -> None:
    variant = Variant("plugin", "plugin", "plugin", args.policy)
    ready, ready_child = multiprocessing.Pipe()
    commands_child, commands = multiprocessing.Pipe()
    engine = multiprocessing.Process(
        target=_engine_process, args=(args.policy, ready_child, commands_child), daemon=True
    )
    if args.engine is None:
        engine.start()
    try:
        engine_base = ready.recv() if args.engine is None else args.engine.rstrip("/")
        section = fair_sched_section(variant, engine_base)
        if args.reserve_slots:
            section["tiers"][0]["reserve_slots"] = args.reserve_slots
            section["backends"]["tiny"]["max_num_seqs"] = 8

        def take() -> list[Seen]:
            if args.engine is not None:
                return []
            commands.send("take")
            seen: list[Seen] = ready.recv()
            return seen

        with tempfile.TemporaryDirectory() as workdir:
            cfg = litellm_config(f"{engine_base}/v1", section)
            async with (
                litellm_proxy(cfg, Path(workdir), "breakdown") as proxy,
                make_client(args.flood + 16) as client,
            ):
                base = proxy.base_url
                power = Caller("power", "power", POWER_KEY)
                await stream_one(client, base, power, 4, time.perf_counter())
                take()
                idle = []
                for _ in range(IDLE_ROUNDS):
                    for index in range(2):
                        idle.append(await _light(client, base, index))
                    await asyncio.sleep(0.2)
                idle_all = take()
                light_tokens = max((s.prompt_tokens for s in idle_all), default=0)
                idle_seqs = [s for s in idle_all if s.prompt_tokens == light_tokens]
                started = time.monotonic()

                async def flood_light() -> list[tuple[float, float | None, float]]:
                    await asyncio.sleep(1.0)
                    return list(await asyncio.gather(*(_light(client, base, i) for i in range(2))))

                power_records, flood = await asyncio.gather(
                    asyncio.gather(
                        *(
                            stream_one(client, base, power, MAX_TOKENS, started)
                            for _ in range(args.flood)
                        )
                    ),
                    flood_light(),
                )
                makespan = time.monotonic() - started
                seen = take()
                tokens = sum(r.tokens for r in power_records) + 2 * MAX_TOKENS
                flood_seqs = [s for s in seen if s.prompt_tokens == light_tokens]
    finally:
        if args.engine is None:
            commands.send("stop")
            engine.join(10)
    if args.engine is not None:
        rows = {
            "idle": [_parts(*pair, None, []) for pair in idle],
            "flood": [_parts(*pair, None, []) for pair in flood],
        }
    else:
        rows = {
            "idle": [_parts(*p, seq, idle_seqs) for p, seq in zip(idle, idle_seqs, strict=True)],
            "flood": [_parts(*p, seq, seen) for p, seq in zip(flood, flood_seqs, strict=True)],
        }
    names = list(rows["idle"][0])
    print(
        f"\nengine policy {args.policy}, reserve_slots {args.reserve_slots}, "
        f"flood {args.flood} x {MAX_TOKENS} tokens"
    )
    print("| light request, median ms | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for label, parts in rows.items():
        cells = [f"{statistics.median(p[name] for p in parts) * 1000:.0f}" for name in names]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(
        f"flood: {tokens} tokens in {makespan:.2f} s = {tokens / makespan:.0f} tokens/s; "
        f"errors {sum(1 for r in power_records if r.error)}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs")
    parser.add_argument("--reserve-slots", type=int, default=0)
    parser.add_argument("--flood", type=int, default=100)
    parser.add_argument(
        "--engine",
        default=None,
        help="a running engine's base URL (8 slots) instead of the emulator",
    )
    asyncio.run(main(parser.parse_args()))
