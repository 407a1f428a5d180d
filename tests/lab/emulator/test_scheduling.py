"""Continuous batching and queue order: the FIFO problem and vLLM's priority policy."""

from __future__ import annotations

import asyncio

import httpx

from fair_sched_plugin.lab.emulator import RunningEmulator, run_emulator

from .conftest import WaitUntil, chat_body, fast_config, open_client

FLOOD_SIZE = 100


async def _flood_then_late_request(
    emu: RunningEmulator,
    wait_until: WaitUntil,
    flood_priority: int,
    late_priority: int,
) -> int:
    """Queue a flood from one user, then one request from another; return how many flood
    requests finished before the late one."""
    async with open_client(emu) as http:
        flood = [
            asyncio.create_task(
                http.post(
                    "/v1/chat/completions", json=chat_body(user="power", priority=flood_priority)
                )
            )
            for _ in range(FLOOD_SIZE)
        ]
        await wait_until(lambda: emu.engine.statistics().requests_received == FLOOD_SIZE)
        late = await http.post(
            "/v1/chat/completions", json=chat_body(user="late", priority=late_priority)
        )
        responses = await asyncio.gather(*flood)
    assert late.status_code == 200
    assert all(response.status_code == 200 for response in responses)
    user_of = {received.request_id: received.user for received in emu.engine.received}
    finish_order = [user_of[request_id] for request_id in emu.engine.finished]
    return finish_order.index("late")


async def test_fifo_late_request_waits_behind_the_flood(wait_until: WaitUntil) -> None:
    async with run_emulator(fast_config(max_num_seqs=8)) as emu:
        finished_before_late = await _flood_then_late_request(emu, wait_until, 0, 0)
        assert emu.engine.statistics().max_waiting_seen >= FLOOD_SIZE - 8
    assert finished_before_late >= 80


async def test_priority_policy_lets_a_lower_value_jump_the_queue(wait_until: WaitUntil) -> None:
    async with run_emulator(fast_config(max_num_seqs=8, policy="priority")) as emu:
        finished_before_late = await _flood_then_late_request(emu, wait_until, 10, 0)
    assert finished_before_late < 30


async def test_negative_priority_jumps_a_default_priority_flood(wait_until: WaitUntil) -> None:
    async with run_emulator(fast_config(max_num_seqs=8, policy="priority")) as emu:
        finished_before_late = await _flood_then_late_request(emu, wait_until, 0, -1)
    assert finished_before_late < 30


async def test_fcfs_rejects_a_non_zero_priority(
    client: httpx.AsyncClient, emu: RunningEmulator
) -> None:
    rejected = await client.post("/v1/chat/completions", json=chat_body(priority=5))
    accepted = await client.post("/v1/chat/completions", json=chat_body(priority=0))
    assert rejected.status_code == 400
    assert "priority" in rejected.json()["error"]["message"].lower()
    assert accepted.status_code == 200
    assert emu.engine.statistics().requests_received == 1


async def test_received_log_records_the_body_priority(wait_until: WaitUntil) -> None:
    async with run_emulator(fast_config(policy="priority")) as emu, open_client(emu) as http:
        for priority in (3, -2, 0):
            response = await http.post(
                "/v1/completions", json={"prompt": "x", "priority": priority}
            )
            assert response.status_code == 200
    assert [received.priority for received in emu.engine.received] == [3, -2, 0]


async def test_never_more_than_max_num_seqs_run_at_once(wait_until: WaitUntil) -> None:
    async with run_emulator(fast_config(max_num_seqs=4)) as emu, open_client(emu) as http:
        requests = [
            http.post("/v1/chat/completions", json=chat_body(max_tokens=8)) for _ in range(20)
        ]
        responses = await asyncio.gather(*requests)
        stats = emu.engine.statistics()
    assert [r.json()["usage"]["completion_tokens"] for r in responses] == [8] * 20
    assert stats.max_running_seen == 4
    assert stats.requests_finished == 20
    assert stats.generation_tokens_total == 20 * 8


async def test_engine_loop_starts_lazily_and_sleeps_when_idle() -> None:
    async with run_emulator(fast_config()) as emu, open_client(emu) as http:
        assert not emu.engine.loop_started
        await http.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert emu.engine.loop_started
        steps_after_request = emu.engine.statistics().steps
        # Twenty 1 ms steps' worth of idle time: a polling loop would have stepped meanwhile.
        await asyncio.sleep(0.02)
        assert emu.engine.statistics().steps == steps_after_request == 2
