"""Engine credentials and vouched principals through a real LiteLLM proxy (one process).

The engine's api_base carries a password and a `?token=`: no response header or body, status
field, metric label or line of the proxy's log may show either. A principal's key that LiteLLM
cannot hash-match (it does not start with `sk-`) is recognised only through the name our
`authenticate` vouches for, which must survive LiteLLM's handling of the auth object.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from fair_sched_plugin.lab.harness.litellm_proxy import (
    MASTER_KEY,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
)

from ..integrations.conftest import chat_body, emulator
from ..integrations.litellm_harness import NEEDS_LITELLM
from .test_security import assert_no_engine_credential, credentialed

pytestmark = [pytest.mark.litellm, NEEDS_LITELLM]

# Not `sk-...`: LiteLLM stores no hash we could match, so only the vouched name identifies it.
BATCH_KEY = "batch-key-2f81c0"


async def test_engine_credentials_never_reach_clients_through_litellm(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    async with emulator() as emu:
        fair_sched: dict[str, Any] = {
            "tiers": [
                {"name": "interactive", "waiting_below": 3},
                {"name": "batch", "waiting_below": 3},
            ],
            "principals": [{"name": "bot", "keys": [BATCH_KEY], "tier": "batch"}],
            "metrics_poll_ms": 50,
            "stale_after_ms": 300,
        }
        # LiteLLM's own client cannot send to an api_base with a password (it has an api_key
        # too) or a query (it appends the path after it): the live engine's metrics URL has
        # them, the dead engine's api_base too (the request fails there anyway).
        fair_sched["backends"] = {
            model: {"metrics_url": credentialed(base).replace("/v1?", "/metrics?")}
            for model, base in (("tiny", emu.base_url), ("gone", dead))
        }
        config = proxy_config(
            [model_entry("tiny", f"{emu.base_url}/v1"), model_entry("gone", credentialed(dead))],
            fair_sched,
        )
        seen: list[str] = []
        async with (
            litellm_proxy(config, tmp_path, "credentials") as proxy,
            open_client(proxy.base_url, BATCH_KEY) as bot,
            open_client(proxy.base_url, MASTER_KEY) as admin,
        ):
            ok = await bot.post("/v1/chat/completions", json=chat_body())
            assert ok.status_code == 200, ok.text
            # Recognised through the name our authenticate vouched for, not the key's hash.
            assert ok.headers["x-fair-sched-tier"] == "batch"
            assert ok.headers["x-fair-sched-deployment"] == f"{emu.base_url}/v1"
            gone = await bot.post("/v1/chat/completions", json=chat_body(model="gone"))
            assert gone.status_code >= 400
            for response in (ok, gone):
                seen.append(response.text + json.dumps(list(response.headers.items())))

            # The dead engine's gate fell back (its metrics never came): logged and in status.
            for _ in range(400):
                status = (await admin.get("/fair-sched/status")).json()
                if any(t["model"] == "gone" for t in status["transitions"]):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the gate of `gone` never fell back")
            for path in ("/fair-sched/status", "/fair-sched/metrics"):
                answer = await admin.get(path)
                assert answer.status_code == 200
                seen.append(answer.text)
            log = proxy.log_text()
    assert f"{emu.base_url}/v1" in seen[-1]  # the metric labels name the deployment, safely
    assert_no_engine_credential("\n".join(seen), "a response, the status or the metrics")
    assert "fair_sched gate model=gone" in log, log[-3000:]
    assert_no_engine_credential(log, "the LiteLLM proxy's log")
