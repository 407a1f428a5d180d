"""The configs in `examples/` do what their headers and the README say, run as a new user would."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from fair_sched_plugin.config import FairSchedSettings, load_settings
from fair_sched_plugin.lab.emulator.server import RunningEmulator
from fair_sched_plugin.lab.harness.litellm_proxy import (
    free_port,
    litellm_proxy,
    open_client,
    proxy_env,
    stream_chat,
    write_config,
)
from fair_sched_plugin.lab.harness.processes import own_process_group

from ..support import wait_healthy
from .conftest import emulator, received_priorities, serve
from .litellm_harness import NEEDS_LITELLM

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_MASTER_KEY = "sk-example-master-5d1c"  # as the example's header starts the proxy
EXAMPLE_KEY = "sk-alice-1"


def example(name: str) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text(encoding="utf-8"))
    return config


def pointed_at(name: str, emu: RunningEmulator) -> dict[str, Any]:
    """An example's config with its one engine address (the emulator's :8000) moved to `emu`."""
    config = example(name)
    (backend,) = config["fair_sched"]["backends"].values()
    backend["api_base"] = f"{emu.base_url}/v1"
    return config


def chat(max_tokens: int = 20) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me about fair scheduling."}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda path: path.name)
def test_every_example_config_loads_through_the_config_loader(path: Path) -> None:
    settings = load_settings(path)
    assert isinstance(settings, FairSchedSettings)
    assert "tiny" in settings.backends  # the example's own section, not the defaults


def load_asgi_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("asgi_app_example", EXAMPLES / "asgi_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_asgi_example_app_schedules_and_relays_a_stream() -> None:
    async with emulator(policy="priority") as emu:
        app = load_asgi_example().build_app(pointed_at("fair_sched.yaml", emu))
        async with serve(app) as url, open_client(url, EXAMPLE_KEY, 60.0) as client:
            result = await stream_chat(client, "/v1/chat/completions", chat())
            stranger = await client.post("/v1/chat/completions", json={"model": 1})
    assert result.error is None and result.content_chunks == 20
    assert stranger.status_code == 400
    assert received_priorities(emu) == [0]  # the tier's vllm_priority reached the engine


async def test_the_asgi_example_app_answers_404_for_a_model_it_does_not_serve() -> None:
    async with emulator(policy="priority") as emu:
        app = load_asgi_example().build_app(pointed_at("fair_sched.yaml", emu))
        async with serve(app) as url, open_client(url, EXAMPLE_KEY, 60.0) as client:
            response = await client.post(
                "/v1/chat/completions", json={**chat(), "model": "not-served"}
            )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def spawn_proxy(config_path: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "fair_sched_plugin.cli", "proxy", "--config", str(config_path),
             "--port", str(port)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=proxy_env(),
            **own_process_group(),
        )  # fmt: skip


def log_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@contextlib.asynccontextmanager
async def fair_sched_proxy(config_path: Path, log_path: Path) -> AsyncIterator[str]:
    """`fair-sched proxy --config config_path` on a free port, once it answers /health."""
    port = free_port()
    process = spawn_proxy(config_path, port, log_path)
    base_url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base_url, process, lambda: log_text(log_path))
        yield base_url
    finally:
        process.kill()
        await asyncio.to_thread(process.wait, 10)


async def test_the_proxy_example_starts_and_serves_its_keys(tmp_path: Path) -> None:
    async with emulator(policy="priority") as emu:
        config_path = write_config(tmp_path, "proxy", pointed_at("fair_sched_proxy.yaml", emu))
        async with (
            fair_sched_proxy(config_path, tmp_path / "proxy.log") as url,
            open_client(url, EXAMPLE_KEY, 60.0) as client,
            open_client(url, "sk-made-up", 60.0) as stranger,
            open_client(url, "sk-example-admin-3e9b", 60.0) as admin,
        ):
            result = await stream_chat(client, "/v1/chat/completions", chat())
            refused = await stranger.post("/v1/chat/completions", json=chat())
            status = await admin.get("/fair-sched/status")
    assert result.error is None and result.content_chunks == 20
    assert refused.status_code == 401
    assert status.status_code == 200


@pytest.mark.litellm
@pytest.mark.slow
@NEEDS_LITELLM
async def test_a_long_stream_through_the_litellm_example_completes(tmp_path: Path) -> None:
    """LiteLLM's own check fails a stream after 100 identical chunks in a row ("The model is
    repeating the same chunk"); the emulator the example runs against must not trip it."""
    config = example("litellm_config.yaml")
    async with emulator(policy="priority") as emu:
        (entry,) = config["model_list"]
        entry["litellm_params"]["api_base"] = f"{emu.base_url}/v1"  # the example's is :8000
        # LiteLLM's default, which the tests' other proxies lift.
        env = {"LITELLM_MASTER_KEY": EXAMPLE_MASTER_KEY, "REPEATED_STREAMING_CHUNK_LIMIT": "100"}
        async with (
            litellm_proxy(config, tmp_path, "example", env=env) as proxy,
            open_client(proxy.base_url, "sk-alice-1", 60.0) as client,
        ):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 400,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            result = await stream_chat(client, "/v1/chat/completions", body)
    assert result.error is None and result.status == 200
    assert result.content_chunks == 400
    assert result.usage is not None and result.usage["completion_tokens"] == 400
