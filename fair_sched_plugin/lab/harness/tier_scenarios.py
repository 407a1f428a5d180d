"""Cost fairness, budgets, tier shares and promotion through real `litellm` proxy processes in
front of emulators.

Shared by `test_litellm_budgets_shares.py` (short windows) and
`benchmarks/tier_shares_and_costs.py` (a 60 s window, numbers printed). What was delivered is
read from the emulators' own logs of received requests (in release order), so the measure is
what the scheduler let through, not what the clients happened to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fair_sched_plugin.lab.emulator.engine import EmulatorConfig
from fair_sched_plugin.lab.emulator.server import RunningEmulator, run_emulator

from .litellm_proxy import (
    MASTER_KEY,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
    stream_chat,
)
from .loopback import eventually

# Slow enough that the engines, not the proxy's CPU, are the bottleneck: the plugin's queues
# must hold the backlog for fairness to decide anything.
SLOTS = 4
SLOW_STEPS: dict[str, Any] = {
    "base_step_ms": 20.0,
    "step_ms_per_running_seq": 0.0,
    "prefill_ms_per_token": 0.0,
}
# Money per million tokens; the dear model costs six times the cheap one.
PRICES = {
    "cheap": {"input_per_mtok": 0.5, "output_per_mtok": 1.5},
    "dear": {"input_per_mtok": 3.0, "output_per_mtok": 9.0},
}
# Sizes tag the sender at the engine: team A asks for even output lengths, team B for odd ones.
TEAM_SIZES = {"team-a": (8, 24, 48), "team-b": (9, 25, 49)}
TEAM_KEYS = {"team-a": "sk-team-a", "team-b": "sk-team-b"}
PROMPTS = ("Summarise fair queuing.", "Explain weighted fair queuing in detail. " * 10)
WORKERS_PER_MODEL = 6  # per team and model: always more than the engine's slots can take


def request_cost(model: str, prompt_tokens: int, output_tokens: int) -> float:
    price = PRICES[model]
    return (
        prompt_tokens * price["input_per_mtok"] + output_tokens * price["output_per_mtok"]
    ) / 1e6


async def closed_loop(
    client: httpx.AsyncClient,
    body: Callable[[], Mapping[str, Any]],
    stop: asyncio.Event,
    max_requests: int = 10_000,
) -> list[int]:
    """Send one request after another until `stop` (bounded in count); the status codes."""
    statuses = []
    for _ in range(max_requests):
        if stop.is_set():
            break
        response = await client.post("/v1/chat/completions", json=dict(body()))
        statuses.append(response.status_code)
    return statuses


@contextlib.asynccontextmanager
async def backlogged(
    senders: Sequence[tuple[httpx.AsyncClient, Callable[[], Mapping[str, Any]]]],
) -> AsyncIterator[None]:
    """Keep every sender's closed loop running inside the block; stop and collect them after."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(closed_loop(client, body, stop)) for client, body in senders]
    try:
        yield
    finally:
        stop.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
            bad = [status for status in result if status != 200]
            assert not bad, f"non-200 answers while backlogged: {Counter(bad)}"


@dataclass
class CostResult:
    delivered: dict[str, float]  # team -> money released during the window
    requests: dict[str, int]

    @property
    def ratio(self) -> float:
        return self.delivered["team-a"] / self.delivered["team-b"]


def cost_section() -> dict[str, Any]:
    return {
        "tiers": [{"name": "interactive", "waiting_below": 1}],
        "fairness": "cost",
        "principals": [
            {"name": "team-a", "keys": [TEAM_KEYS["team-a"]], "weight": 3},
            {"name": "team-b", "keys": [TEAM_KEYS["team-b"]], "weight": 1},
        ],
        "backends": {model: {"price": price} for model, price in PRICES.items()},
        "metrics_poll_ms": 50,
    }


async def cost_fairness(directory: Path, *, warmup_s: float, window_s: float) -> CostResult:
    """Teams weighted 3:1 under `fairness: cost`, both backlogged on two differently priced
    models with requests of different sizes: the money each team got released in the window."""
    config = EmulatorConfig(models=("tiny",), max_num_seqs=SLOTS, **SLOW_STEPS)
    async with contextlib.AsyncExitStack() as exits:
        emus: dict[str, RunningEmulator] = {}
        for model in PRICES:
            emus[model] = await exits.enter_async_context(run_emulator(config))
        models = [model_entry(model, f"{emu.base_url}/v1") for model, emu in emus.items()]
        proxy = await exits.enter_async_context(
            litellm_proxy(proxy_config(models, cost_section()), directory, "cost")
        )
        rng = random.Random(19)
        senders = []
        for team, key in TEAM_KEYS.items():
            client = await exits.enter_async_context(open_client(proxy.base_url, key, 120.0))
            for model in PRICES:

                def body(model: str = model, team: str = team) -> Mapping[str, Any]:
                    return {
                        "model": model,
                        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                        "max_tokens": rng.choice(TEAM_SIZES[team]),
                    }

                senders.extend([(client, body)] * WORKERS_PER_MODEL)
        async with backlogged(senders):
            await asyncio.sleep(warmup_s)
            start = {model: len(emu.engine.received) for model, emu in emus.items()}
            await asyncio.sleep(window_s)
            end = {model: len(emu.engine.received) for model, emu in emus.items()}
    delivered = {team: 0.0 for team in TEAM_KEYS}
    requests = {team: 0 for team in TEAM_KEYS}
    for model, emu in emus.items():
        received = list(emu.engine.received)
        for request in received[start[model] : end[model]]:
            team = "team-a" if request.max_tokens % 2 == 0 else "team-b"
            delivered[team] += request_cost(model, request.prompt_tokens, request.max_tokens)
            requests[team] += 1
    return CostResult(delivered, requests)


async def queued_in_plugin(base_url: str, model: str, *, at_least: int) -> bool:
    """Whether the plugin's status document shows at least `at_least` requests queued on
    `model` (what a fixed sleep used to wait for)."""
    async with open_client(base_url, MASTER_KEY) as admin:
        response = await admin.get("/fair-sched/status")
    assert response.status_code == 200, response.text
    queued: dict[str, int] = response.json()["models"].get(model, {}).get("queued", {})
    return sum(queued.values()) >= at_least


# ---------------------------------------------------------------------------- tier shares


def share_section(*, promote_after_s: float | None = None) -> dict[str, Any]:
    batch: dict[str, Any] = {"name": "batch", "waiting_below": 1}
    interactive: dict[str, Any] = {"name": "interactive", "waiting_below": 1}
    if promote_after_s is None:
        interactive["share"], batch["share"] = 0.8, 0.2
    else:
        batch["promote_after_s"] = promote_after_s
    return {
        "tiers": [interactive, batch],
        "principals": [
            {"name": "chat", "keys": ["sk-chat"], "tier": "interactive"},
            {"name": "chat-2", "keys": ["sk-chat-2"], "tier": "interactive"},
            {"name": "ci", "keys": ["sk-ci"], "tier": "batch"},
        ],
        "metrics_poll_ms": 50,
    }


INTERACTIVE_TOKENS, BATCH_TOKENS = 16, 17  # tags at the engine
# Longer interactive requests while promotion is measured: fewer releases a second, so the
# proxy's own delay in taking a request (under load on two shared cores) moves the count less.
PROMOTION_INTERACTIVE_TOKENS = 48


def fixed_body(max_tokens: int) -> Callable[[], Mapping[str, Any]]:
    def body() -> Mapping[str, Any]:
        return {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hello there."}],
            "max_tokens": max_tokens,
        }

    return body


async def tier_shares(directory: Path, *, warmup_s: float, window_s: float) -> Counter[str]:
    """Tiers sharing 0.8/0.2, one backlogged user in each: requests released per tier."""
    config = EmulatorConfig(models=("tiny",), max_num_seqs=SLOTS, **SLOW_STEPS)
    async with contextlib.AsyncExitStack() as exits:
        emu = await exits.enter_async_context(run_emulator(config))
        models = [model_entry("tiny", f"{emu.base_url}/v1")]
        proxy = await exits.enter_async_context(
            litellm_proxy(proxy_config(models, share_section()), directory, "shares")
        )
        chat = await exits.enter_async_context(open_client(proxy.base_url, "sk-chat", 120.0))
        ci = await exits.enter_async_context(open_client(proxy.base_url, "sk-ci", 120.0))
        senders = [(chat, fixed_body(INTERACTIVE_TOKENS))] * 8
        senders += [(ci, fixed_body(BATCH_TOKENS))] * 8
        async with backlogged(senders):
            await asyncio.sleep(warmup_s)
            start = len(emu.engine.received)
            await asyncio.sleep(window_s)
            window = list(emu.engine.received)[start:]
    return Counter(
        "interactive" if request.max_tokens == INTERACTIVE_TOKENS else "batch" for request in window
    )


@dataclass
class PromotionResult:
    # Per batch request: requests the engine received between its promotion time and itself.
    released_after_promotion: list[int]


async def promotion(directory: Path, *, promote_after_s: float, count: int) -> PromotionResult:
    """Two interactive users keep the engine busy under strict tiers; a batch user sends
    `count` requests one after another, each promoted after `promote_after_s`."""
    config = EmulatorConfig(models=("tiny",), max_num_seqs=SLOTS, **SLOW_STEPS)
    async with contextlib.AsyncExitStack() as exits:
        emu = await exits.enter_async_context(run_emulator(config))
        models = [model_entry("tiny", f"{emu.base_url}/v1")]
        section = share_section(promote_after_s=promote_after_s)
        proxy = await exits.enter_async_context(
            litellm_proxy(proxy_config(models, section), directory, "promote")
        )
        senders = []
        for key in ("sk-chat", "sk-chat-2"):
            client = await exits.enter_async_context(open_client(proxy.base_url, key, 120.0))
            senders += [(client, fixed_body(PROMOTION_INTERACTIVE_TOKENS))] * 8
        ci = await exits.enter_async_context(open_client(proxy.base_url, "sk-ci", 120.0))
        # The batch user's first request through a fresh proxy (connection, key lookup) takes
        # the proxy longer to accept: send it while nothing is queued, so what is measured
        # below is the promotion, not that.
        warmup = await ci.post("/v1/chat/completions", json=dict(fixed_body(BATCH_TOKENS)()))
        assert warmup.status_code == 200, warmup.text
        counts: list[int] = []
        async with backlogged(senders):
            # The interactive backlog is there: the engine is full and the plugin holds more.
            await eventually(lambda: queued_in_plugin(proxy.base_url, "tiny", at_least=4), 60)
            for _ in range(count):
                sent_at = len(emu.engine.received)
                sending = asyncio.create_task(
                    ci.post("/v1/chat/completions", json=dict(fixed_body(BATCH_TOKENS)()))
                )
                await asyncio.sleep(promote_after_s)
                promoted_at = len(emu.engine.received)
                # Strict tiers would starve it for as long as the interactive users keep up.
                response = await asyncio.wait_for(sending, 10 * promote_after_s)
                assert response.status_code == 200, response.text
                received = list(emu.engine.received)
                index = next(
                    i
                    for i in range(sent_at, len(received))
                    if received[i].max_tokens == BATCH_TOKENS
                )
                counts.append(index - promoted_at)
    return PromotionResult(counts)


# ---------------------------------------------------------------------------- budgets

HEAVY_WAVE1, HEAVY_WAVE2, LIGHT_TOKENS = 64, 40, 3  # tags at the engine
BUDGET_TOKENS = 200  # four wave-1 requests (4 x ~66 tokens) overspend it


def budget_section() -> dict[str, Any]:
    budget = {"tokens": BUDGET_TOKENS, "per": "minute"}
    return {
        "tiers": [
            {"name": "interactive", "waiting_below": 1, "vllm_priority": 0},
            {"name": "batch", "waiting_below": 1, "vllm_priority": 10},
        ],
        "principals": [
            {"name": "light", "keys": ["sk-light"]},
            {"name": "heavy-free", "keys": ["sk-heavy-free"]},
            {
                "name": "heavy-demote",
                "keys": ["sk-heavy-demote"],
                "budget": {**budget, "action": "demote", "demote_to": "batch"},
            },
            {
                "name": "heavy-reject",
                "keys": ["sk-heavy-reject"],
                "budget": {**budget, "action": "reject"},
            },
        ],
        "backends": {"tiny": {"priority_scheduling": True}},
        "metrics_poll_ms": 50,
    }


@dataclass
class FloodResult:
    light_ttft: list[float]
    wave1_priorities: list[int]
    wave2_priorities: list[int]
    # Per light request: heavy requests the engine received between its sending and itself.
    light_overtaken: list[int]


async def heavy_flood_with_light_user(
    base_url: str, emu: RunningEmulator, heavy_key: str, *, wave2: int = 24, light: int = 6
) -> FloodResult:
    """The heavy principal spends with four requests, then floods; a light interactive user
    sends `light` streaming requests one after another under the flood."""
    start = len(emu.engine.received)
    async with open_client(base_url, heavy_key, 120.0) as heavy:
        first = [
            heavy.post("/v1/chat/completions", json=dict(fixed_body(HEAVY_WAVE1)()))
            for _ in range(4)
        ]
        assert all(r.status_code == 200 for r in await asyncio.gather(*first))
        flood = [
            asyncio.create_task(
                heavy.post("/v1/chat/completions", json=dict(fixed_body(HEAVY_WAVE2)()))
            )
            for _ in range(wave2)
        ]
        # The flood is parked in the plugin before the light user starts.
        await eventually(lambda: queued_in_plugin(base_url, "tiny", at_least=wave2 - 2 * SLOTS), 60)
        ttfts = []
        overtaken = []
        async with open_client(base_url, "sk-light", 120.0) as client:
            body = {**fixed_body(LIGHT_TOKENS)(), "stream": True}
            for _ in range(light):
                sent_at = len(emu.engine.received)
                result = await stream_chat(client, "/v1/chat/completions", body)
                assert result.status == 200 and result.ttft is not None, result.error
                ttfts.append(result.ttft)
                since = list(emu.engine.received)[sent_at:]
                arrived = next(i for i, r in enumerate(since) if r.max_tokens == LIGHT_TOKENS)
                overtaken.append(sum(r.max_tokens == HEAVY_WAVE2 for r in since[:arrived]))
        assert all(r.status_code == 200 for r in await asyncio.gather(*flood))
    received = list(emu.engine.received)[start:]
    return FloodResult(
        ttfts,
        [r.priority for r in received if r.max_tokens == HEAVY_WAVE1],
        [r.priority for r in received if r.max_tokens == HEAVY_WAVE2],
        overtaken,
    )


async def reject_until_429(base_url: str) -> tuple[httpx.Response, float]:
    """Spend the reject budget one request at a time; the first 429 and the seconds since the
    first request was sent (the budget window opened when that one ended)."""
    async with open_client(base_url, "sk-heavy-reject", 60.0) as client:
        first_sent = time.monotonic()
        for _ in range(10):
            response = await client.post(
                "/v1/chat/completions", json=dict(fixed_body(HEAVY_WAVE1)())
            )
            if response.status_code == 429:
                return response, time.monotonic() - first_sent
            assert response.status_code == 200, response.text
    raise AssertionError("ten requests never overspent the budget")


@contextlib.asynccontextmanager
async def budget_stack(directory: Path) -> AsyncIterator[tuple[str, RunningEmulator]]:
    config = EmulatorConfig(models=("tiny",), max_num_seqs=SLOTS, policy="priority", **SLOW_STEPS)
    async with run_emulator(config) as emu:
        models = [model_entry("tiny", f"{emu.base_url}/v1")]
        async with litellm_proxy(proxy_config(models, budget_section()), directory, "budget") as p:
            yield p.base_url, emu


async def warm(base_url: str, key: str, model: str = "tiny") -> None:
    """The first request through a fresh proxy pays for imports: send it before measuring."""
    async with open_client(base_url, key, 60.0) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
        assert response.status_code == 200, response.text
