"""The flood scenario (docs/results.md, "The flood demo"), played through several gateways.

One power user sends N streaming requests at once; one second later two light users send one
each. Each variant has its own engine (a fresh emulator, so its statistics are its own) and its
own gateway in front of it: none (direct), LiteLLM, LiteLLM with the plugin, or, where the plugin
is not installed, the standalone fair proxy standing in for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ...observability import UI_PATH
from .browser import screenshot_while
from .client import Caller, RequestRecord, make_client, send_wave, stream_one
from .processes import (
    MASTER_KEY,
    ChildProcess,
    EmulatorSettings,
    emulator_process,
    engine_stats,
    enter_side_by_side,
    fair_proxy,
    litellm_config,
    litellm_proxy,
    plugin_available,
)
from .stats import summarize_flood, ttft_p50

Gateway = Literal["direct", "litellm", "plugin", "fair_proxy"]
LIGHT_DELAY_S = 1.0
POWER_KEY = "sk-demo-power-5b1d"
LIGHT_KEYS = ("sk-demo-light1-0c3e", "sk-demo-light2-8a4f")


@dataclass(frozen=True)
class FloodSize:
    power_requests: int = 100
    max_tokens: int = 64


# 100 requests x 64 tokens on 8 slots = 800 steps of ~16 ms (12 + 0.5 per running sequence):
# about 13 s of engine time for the default flood.
DEMO_ENGINE = EmulatorSettings(max_num_seqs=8, policy="fcfs", step_ms=12.0, step_ms_per_seq=0.5)
DEMO_SIZE = FloodSize(power_requests=100, max_tokens=64)
# The quick flood is smaller but runs on a slower engine, so that it still lasts well past the
# light users' arrival (24 x 48 tokens / 8 slots x ~34 ms = ~5 s) and the engine, not the
# proxies' CPU, stays the bottleneck.
QUICK_SIZE = FloodSize(power_requests=24, max_tokens=48)
QUICK_ENGINE = EmulatorSettings(max_num_seqs=8, policy="fcfs", step_ms=30.0, step_ms_per_seq=0.5)
WARM_UP_TOKENS = 4


@dataclass(frozen=True)
class Variant:
    """One way of putting a gateway between the users and the engine."""

    name: str
    label: str
    gateway: Gateway
    engine_policy: str = "fcfs"
    # The plugin's settings: every user in one tier with this threshold, or tiers (power = batch).
    waiting_below: int | Literal["auto"] = 3
    tiered: bool = False
    # With `waiting_below: auto`: the interactive tier's target, and its minimum (None: the
    # default; 0 lets it keep no engine queue at all).
    ttft_target_ms: float | None = None
    auto_min: int | None = None
    # The engine's running slots, told to the gate (None: learned from its scrapes).
    max_num_seqs: int | None = None
    # Running slots the interactive tier keeps free for a user who holds none (needs
    # `max_num_seqs`).
    reserve_slots: int = 0


def fair_sched_section(variant: Variant, engine_base: str) -> dict[str, Any]:
    """The `fair_sched:` settings of a variant (used by the plugin and by the fair proxy)."""
    power_tier = "batch" if variant.tiered else "interactive"
    waiting_below: Any = variant.waiting_below
    if variant.auto_min is not None:
        waiting_below = {"auto": {"min": variant.auto_min}}
    interactive: dict[str, Any] = {
        "name": "interactive",
        "waiting_below": waiting_below,
        "tpot_below_ms": 150,
        "vllm_priority": 0,
    }
    if variant.ttft_target_ms is not None:
        interactive["ttft_target_ms"] = variant.ttft_target_ms
    if variant.reserve_slots:
        interactive["reserve_slots"] = variant.reserve_slots
    return {
        "tiers": [
            interactive,
            {"name": "batch", "waiting_below": 1, "vllm_priority": 10},
        ],
        "default_tier": "interactive",
        "principals": [
            {"name": "power", "keys": [POWER_KEY], "tier": power_tier},
            {"name": "light-1", "keys": [LIGHT_KEYS[0]], "tier": "interactive"},
            {"name": "light-2", "keys": [LIGHT_KEYS[1]], "tier": "interactive"},
        ],
        "backends": {
            "tiny": {
                "api_base": f"{engine_base}/v1",
                "metrics_url": f"{engine_base}/metrics",
                "engine": "vllm",
                "priority_scheduling": variant.engine_policy == "priority",
                **({"max_num_seqs": variant.max_num_seqs} if variant.max_num_seqs else {}),
            }
        },
        # Generous caps: the demo measures ordering, not rejections.
        "queue": {"max_per_user": 5000, "max_total": 20000, "max_wait_s": 300},
        "metrics_poll_ms": 50,
        # The fair proxy's /fair-sched/ui and /status take this key (LiteLLM its master key).
        "observability": {"admin_key": MASTER_KEY},
    }


def standard_variants(*, with_thresholds: bool = False) -> list[Variant]:
    """The demo's four variants; the bench adds the waiting_below 1 and 8 ones."""
    plugin: Gateway = "plugin" if plugin_available() else "fair_proxy"
    via = "LiteLLM + plugin" if plugin == "plugin" else "fair-sched proxy*"
    variants = [
        Variant("direct", "direct (FIFO)", "direct"),
        Variant("litellm", "LiteLLM", "litellm"),
        Variant("plugin", via, plugin),
        Variant("plugin_priority", f"{via} + priority", plugin, "priority", tiered=True),
    ]
    if with_thresholds:
        variants += [
            Variant("waiting_below_1", f"{via}, waiting_below 1", plugin, waiting_below=1),
            Variant("waiting_below_8", f"{via}, waiting_below 8", plugin, waiting_below=8),
            Variant(
                "reserve_slots_1",
                f"{via}, reserve_slots 1",
                plugin,
                reserve_slots=1,
                max_num_seqs=DEMO_ENGINE.max_num_seqs,
            ),
        ]
    return variants


def callers_for(variant: Variant, size: FloodSize) -> tuple[list[Caller], list[Caller]]:
    """The power user's callers (one per request) and the two light users'."""
    uses_user_keys = variant.gateway in ("plugin", "fair_proxy")
    shared_key = MASTER_KEY if variant.gateway == "litellm" else None

    def key(own: str) -> str | None:
        return own if uses_user_keys else shared_key

    power = [Caller("power", "power", key(POWER_KEY))] * size.power_requests
    light = [Caller(f"light-{i + 1}", "light", key(k)) for i, k in enumerate(LIGHT_KEYS)]
    return power, light


@dataclass
class Target:
    """Where a variant's requests go, and the engine and gateway behind it."""

    variant: Variant
    engine_base: str
    base_url: str
    gateway_pid: int | None = None
    engine_is_emulator: bool = True
    # The plugin's live page (/fair-sched/ui), where the gateway runs the plugin.
    ui_url: str | None = None


@contextlib.asynccontextmanager
async def _gateway(variant: Variant, engine_base: str, workdir: Path) -> AsyncIterator[Target]:
    if variant.gateway == "direct":
        yield Target(variant, engine_base, f"{engine_base}/v1")
        return
    section = fair_sched_section(variant, engine_base)
    gateway: contextlib.AbstractAsyncContextManager[ChildProcess]
    if variant.gateway == "fair_proxy":
        gateway = fair_proxy(section, workdir, variant.name)
    else:
        plugin_section = section if variant.gateway == "plugin" else None
        config = litellm_config(f"{engine_base}/v1", plugin_section)
        gateway = litellm_proxy(config, workdir, variant.name)
    async with gateway as child:
        target = Target(variant, engine_base, child.base_url, child.pid)
        if variant.gateway in ("plugin", "fair_proxy"):
            target.ui_url = child.base_url.removesuffix("/v1") + UI_PATH
        yield target


@contextlib.asynccontextmanager
async def _target(
    variant: Variant, emulator: EmulatorSettings, engine_url: str | None, workdir: Path
) -> AsyncIterator[Target]:
    if engine_url is not None:
        async with _gateway(variant, engine_url.rstrip("/"), workdir) as target:
            target.engine_is_emulator = False
            yield target
        return
    settings = EmulatorSettings(
        emulator.max_num_seqs, variant.engine_policy, emulator.step_ms, emulator.step_ms_per_seq
    )
    async with (
        emulator_process(settings) as engine,
        _gateway(variant, engine.base_url, workdir) as target,
    ):
        yield target


@contextlib.asynccontextmanager
async def started_targets(
    variants: Sequence[Variant],
    emulator: EmulatorSettings,
    engine_url: str | None,
    workdir: Path,
    progress: Callable[[str], None],
) -> AsyncIterator[list[Target]]:
    """Start every variant's engine and gateway at once (proxies import slowly), stop all after.

    Starting them side by side costs one LiteLLM start-up instead of one per variant; they sit
    idle while the others are measured.
    """
    async with contextlib.AsyncExitStack() as stack:
        yield await enter_side_by_side(
            stack,
            [_target(variant, emulator, engine_url, workdir) for variant in variants],
            progress,
            f"starting {len(variants)} engine(s) and gateways ...",
        )


@dataclass
class FloodResult:
    variant: Variant
    records: list[RequestRecord]
    summary: dict[str, Any] = field(default_factory=dict)


async def play_flood(
    target: Target, size: FloodSize, progress: Callable[[str], None]
) -> FloodResult:
    """The flood against one target; the engine's statistics are added to the summary."""
    variant = target.variant
    power, light = callers_for(variant, size)
    async with make_client(connections=size.power_requests + 16) as client:
        progress(
            f"[{variant.name}] sending {len(power)} power requests, "
            f"{len(light)} light requests {LIGHT_DELAY_S:.0f} s later ..."
        )
        if target.ui_url:
            progress(f"[{variant.name}] watch it live: {target.ui_url} (admin key {MASTER_KEY})")
        # The first request through a LiteLLM proxy pays for lazy imports: not part of the flood.
        await stream_one(client, target.base_url, power[0], WARM_UP_TOKENS, time.perf_counter())
        # The light users' requests on the idle engine: what the flood's are compared with.
        idle = await send_wave(client, target.base_url, light, size.max_tokens, time.perf_counter())
        clock_zero = time.perf_counter()
        waves = await asyncio.gather(
            send_wave(client, target.base_url, power, size.max_tokens, clock_zero),
            send_wave(client, target.base_url, light, size.max_tokens, clock_zero, LIGHT_DELAY_S),
        )
        records = [record for wave in waves for record in wave]
        stats = await engine_stats(client, target.engine_base) if target.engine_is_emulator else {}
    summary = summarize_flood(records)
    summary["light_ttft_idle_p50"] = ttft_p50(idle)
    light_p50, idle_p50 = summary["light_ttft_p50"], summary["light_ttft_idle_p50"]
    summary["light_vs_idle"] = light_p50 / idle_p50 if light_p50 is not None and idle_p50 else None
    summary["max_waiting_seen"] = stats.get("max_waiting_seen")
    summary["max_running_seen"] = stats.get("max_running_seen")
    progress(
        f"[{variant.name}] done: {summary['requests'] - summary['errors']} ok, "
        f"{summary['errors']} errors, {summary['generated_tokens']} tokens "
        f"in {summary['makespan_s']:.1f} s"
    )
    for record in records:
        if record.error:
            progress(f"[{variant.name}] first error: {record.error}")
            break
    return FloodResult(variant, records, summary)


async def run_flood(
    variants: Sequence[Variant],
    size: FloodSize,
    emulator: EmulatorSettings,
    engine_url: str | None,
    workdir: Path,
    progress: Callable[[str], None],
) -> list[FloodResult]:
    """Start everything, then play the flood variant by variant (never two at once)."""
    results, _ = await run_flood_and_screenshot(
        variants, size, emulator, engine_url, workdir, progress, screenshot=None
    )
    return results


async def run_flood_and_screenshot(
    variants: Sequence[Variant],
    size: FloodSize,
    emulator: EmulatorSettings,
    engine_url: str | None,
    workdir: Path,
    progress: Callable[[str], None],
    *,
    screenshot: Path | None,
) -> tuple[list[FloodResult], str | None]:
    """`run_flood`, then (with `screenshot`) one unmeasured flood through the plugin variant
    while Chromium photographs its live page; the second value is the report's note on it."""
    async with started_targets(variants, emulator, engine_url, workdir, progress) as targets:
        results = []
        for target in targets:
            results.append(await play_flood(target, size, progress))
        if screenshot is None:
            return results, None
        plugin = next((t for t in targets if t.variant.name == "plugin"), None)
        if plugin is None:
            return results, "No screenshot: the run has no plugin variant."
        return results, await screenshot_during_flood(plugin, size, screenshot, progress)


async def screenshot_during_flood(
    target: Target, size: FloodSize, path: Path, progress: Callable[[str], None]
) -> str:
    """A flood played only to be photographed: `target`'s live page, taken with Chromium.

    Run after the measured floods, so the browser's CPU never shares a measured run. Returns
    the report's sentence about the screenshot (what was taken, or why nothing was).
    """
    if target.ui_url is None:
        return "No screenshot: this gateway does not run the plugin."
    power, light = callers_for(target.variant, size)
    progress(f"[{target.variant.name}] one more flood, for a screenshot of {target.ui_url} ...")
    async with make_client(connections=size.power_requests + 16) as client:

        async def flood() -> None:
            clock_zero = time.perf_counter()
            await asyncio.gather(
                send_wave(client, target.base_url, power, size.max_tokens, clock_zero),
                send_wave(
                    client, target.base_url, light, size.max_tokens, clock_zero, LIGHT_DELAY_S
                ),
            )

        note = await screenshot_while(
            target.ui_url.removesuffix(UI_PATH),
            MASTER_KEY,
            path,
            flood,
            after_s=LIGHT_DELAY_S + 0.5,
        )
    progress(f"[{target.variant.name}] {note}")
    return note
