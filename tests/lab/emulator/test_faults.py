"""Each fault switch does what it says, set in the config or flipped at runtime."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fair_sched_plugin.lab.emulator import (
    EmulatorConfig,
    FaultSwitches,
    RunningEmulator,
    run_emulator,
    run_emulator_subprocess,
)

from .conftest import chat_body, fast_config, open_client


async def test_slow_metrics_time_out_a_short_client_timeout(emu: RunningEmulator) -> None:
    emu.engine.faults.metrics_delay_s = 0.5
    # Only the read is short: a connect under CPU load may take longer than 50 ms.
    async with open_client(emu, timeout=httpx.Timeout(10.0, read=0.05)) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.get("/metrics")
        emu.engine.faults.metrics_delay_s = 0
        assert (await http.get("/metrics", timeout=10.0)).status_code == 200


async def test_failing_metrics_answer_500(client: httpx.AsyncClient, emu: RunningEmulator) -> None:
    emu.engine.faults.metrics_mode = "error"
    assert (await client.get("/metrics")).status_code == 500


async def test_missing_metrics_answer_404(client: httpx.AsyncClient, emu: RunningEmulator) -> None:
    emu.engine.faults.metrics_mode = "missing"
    assert (await client.get("/metrics")).status_code == 404


async def test_garbage_metrics_do_not_parse(
    client: httpx.AsyncClient, emu: RunningEmulator
) -> None:
    emu.engine.faults.metrics_mode = "garbage"
    response = await client.get("/metrics")
    assert response.status_code == 200
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(response.text))


async def test_every_nth_completion_fails_with_500() -> None:
    config = fast_config(faults=FaultSwitches(fail_every_nth_completion=3))
    async with run_emulator(config) as emu, open_client(emu) as http:
        statuses = [
            (await http.post("/v1/chat/completions", json=chat_body(max_tokens=1))).status_code
            for _ in range(6)
        ]
        stats = emu.engine.statistics()
    assert statuses == [200, 200, 500, 200, 200, 500]
    assert stats.requests_received == 4  # failed requests never reach the engine


def marked(max_tokens: int, mark: str, **extra: object) -> dict[str, object]:
    """A chat request whose prompt carries `mark`."""
    return chat_body(max_tokens, messages=[{"role": "user", "content": f"Say {mark}."}], **extra)


async def test_requests_with_a_marked_prompt_fail_with_500(emu: RunningEmulator) -> None:
    emu.engine.faults.update({"fail_prompt": "[fail]"})
    async with open_client(emu) as http:
        failed = await http.post("/v1/chat/completions", json=marked(1, "[fail]"))
        served = await http.post("/v1/chat/completions", json=marked(1, "[okay]"))
        completion = {"model": "emulated-model", "prompt": "Say [fail].", "max_tokens": 1}
        failed_too = await http.post("/v1/completions", json=completion)
    assert (failed.status_code, served.status_code, failed_too.status_code) == (500, 200, 500)
    assert failed.json()["error"]["code"] == 500
    assert emu.engine.statistics().requests_received == 1  # the failed ones never reached it


async def test_streams_with_a_marked_prompt_break_after_their_first_tokens(
    emu: RunningEmulator,
) -> None:
    """The connection closes mid-body: the client reads the first tokens, then a protocol
    error instead of the stream's end; the engine frees the sequence."""
    emu.engine.faults.update({"drop_prompt": "[drop]"})
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    received = bytearray()
    async with open_client(emu) as http:
        with pytest.raises(httpx.RemoteProtocolError):
            async with http.stream(
                "POST", "/v1/chat/completions", json=marked(50, "[drop]", **stream)
            ) as response:
                async for chunk in response.aiter_raw():
                    received += chunk
        whole = await http.post("/v1/chat/completions", json=marked(50, "[okay]", **stream))
        # Not a stream: answered whole, never dropped.
        plain = await http.post("/v1/chat/completions", json=marked(3, "[drop]"))
    assert response.status_code == 200 and b"data: {" in received
    assert b'"usage"' not in received and b"[DONE]" not in received
    assert b'"usage"' in whole.content and whole.text.endswith("data: [DONE]\n\n")
    assert plain.json()["usage"]["completion_tokens"] == 3
    stats = emu.engine.statistics()
    assert (stats.running, stats.waiting, stats.requests_aborted) == (0, 0, 1)


async def test_first_byte_delay_holds_the_response_back(emu: RunningEmulator) -> None:
    emu.engine.faults.first_byte_delay_s = 0.5
    async with open_client(emu, timeout=0.05) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json=chat_body(max_tokens=1))
        emu.engine.faults.first_byte_delay_s = 0
        response = await http.post("/v1/chat/completions", json=chat_body(max_tokens=1))
    assert response.status_code == 200
    # The abandoned request left during its delay: it never reached the engine.
    assert emu.engine.statistics().requests_received == 1


async def test_admin_endpoint_flips_and_validates_faults(
    client: httpx.AsyncClient, emu: RunningEmulator
) -> None:
    flipped = await client.post("/emulator/faults", json={"metrics_mode": "missing"})
    assert flipped.json()["metrics_mode"] == "missing"
    assert emu.engine.faults.metrics_mode == "missing"
    assert (await client.get("/metrics")).status_code == 404
    for bad in ({"no_such_switch": 1}, {"metrics_mode": "on fire"}, {"metrics_delay_s": -1}):
        assert (await client.post("/emulator/faults", json=bad)).status_code == 400
    assert (await client.get("/emulator/faults")).json()["metrics_mode"] == "missing"
    stats = (await client.get("/emulator/stats")).json()
    assert stats["waiting"] == 0 and stats["requests_received"] == 0


async def test_runtime_faults_do_not_change_the_config() -> None:
    config = fast_config()
    async with run_emulator(config) as emu:
        emu.engine.faults.metrics_mode = "error"
    assert config.faults == FaultSwitches()


@pytest.mark.parametrize(
    "bad",
    [
        {"max_num_seqs": 0},
        {"policy": "lifo"},
        {"metrics_profile": "triton"},
        {"models": ()},
        {"faults": FaultSwitches(metrics_mode="loud")},  # type: ignore[arg-type]
    ],
)
def test_config_rejects_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        EmulatorConfig(**bad)


async def test_subprocess_emulator_serves_and_flips_faults() -> None:
    config = dataclasses.replace(fast_config(), faults=FaultSwitches(metrics_mode="error"))
    async with (
        run_emulator_subprocess(config) as process,
        httpx.AsyncClient(base_url=process.base_url, timeout=10) as http,
    ):
        assert (await http.get("/metrics")).status_code == 500
        await http.post("/emulator/faults", json={"metrics_mode": "ok"})
        reply = await http.post("/v1/chat/completions", json=chat_body(max_tokens=3))
        metrics = (await http.get("/metrics")).text
    assert reply.json()["usage"]["completion_tokens"] == 3
    assert 'vllm:generation_tokens_total{engine="0",model_name="emulated-model"} 3.0' in metrics
    assert process.process.returncode is not None  # stopped on exit


async def test_the_slow_fault_stretches_every_step() -> None:
    """`slow` changes the engine's speed while it runs. A ratio of
    two runs on this machine, never an absolute time: 4x slower steps take at least 2x longer."""
    config = dataclasses.replace(fast_config(), base_step_ms=5.0, step_ms_per_running_seq=0.0)
    async with run_emulator(config) as emu, open_client(emu) as http:
        timings = []
        for slow in (1.0, 4.0):
            emu.engine.faults.update({"slow": slow})
            steps_before = emu.engine.statistics().steps
            started = asyncio.get_running_loop().time()
            response = await http.post("/v1/chat/completions", json=chat_body(max_tokens=20))
            assert response.status_code == 200
            timings.append(asyncio.get_running_loop().time() - started)
            assert emu.engine.statistics().steps - steps_before >= 20
    assert timings[1] >= 2 * timings[0]


def test_the_slow_fault_must_be_positive() -> None:
    with pytest.raises(ValueError, match="slow must be a number > 0"):
        FaultSwitches(slow=0).validate()
