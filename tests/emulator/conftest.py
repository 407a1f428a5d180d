"""Fixtures for the emulator tests: real servers on 127.0.0.1, bounded waits, no fixed sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from fair_sched_plugin.emulator import EmulatorConfig, RunningEmulator, run_emulator

# A fast, flat step: orderings are what the tests check, so time per step only costs runtime.
FAST_STEPS = {"base_step_ms": 1.0, "step_ms_per_running_seq": 0.0, "prefill_ms_per_token": 0.0}

WaitUntil = Callable[[Callable[[], bool]], Awaitable[None]]


def fast_config(**overrides: object) -> EmulatorConfig:
    return EmulatorConfig(**{**FAST_STEPS, **overrides})  # type: ignore[arg-type]


@pytest.fixture
async def emu() -> AsyncIterator[RunningEmulator]:
    async with run_emulator(fast_config()) as running:
        yield running


@pytest.fixture
async def client(emu: RunningEmulator) -> AsyncIterator[httpx.AsyncClient]:
    async with open_client(emu) as http:
        yield http


def open_client(emu: RunningEmulator, timeout: float | httpx.Timeout = 10.0) -> httpx.AsyncClient:
    # Floods open more than httpx's default 100 connections at once.
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    return httpx.AsyncClient(base_url=emu.base_url, limits=limits, timeout=timeout)


@pytest.fixture
def wait_until() -> WaitUntil:
    async def wait(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Poll ``condition`` every few ms; fail after ``timeout_s`` (never loops unbounded)."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + timeout_s
        while not condition():
            if loop.time() > give_up_at:
                pytest.fail(f"condition not met within {timeout_s} s")
            await asyncio.sleep(0.002)

    return wait


def chat_body(max_tokens: int = 16, **extra: object) -> dict[str, object]:
    return {
        "model": "emulated-model",
        "messages": [{"role": "user", "content": "Tell me about fair scheduling."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
