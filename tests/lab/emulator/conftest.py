"""Fixtures for the emulator tests: real servers on 127.0.0.1, bounded waits, no fixed sleeps."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from fair_sched_plugin.lab.emulator import EmulatorConfig, RunningEmulator, run_emulator

from ... import support

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
    return support.open_client(emu.base_url, timeout=timeout)


@pytest.fixture
def wait_until() -> WaitUntil:
    """`tests.support.eventually`, as a fixture (the emulator tests take it as an argument)."""
    return support.eventually


def chat_body(max_tokens: int = 16, **extra: object) -> dict[str, object]:
    return {
        "model": "emulated-model",
        "messages": [{"role": "user", "content": "Tell me about fair scheduling."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
