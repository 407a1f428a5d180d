"""Hostile clients against the LiteLLM adapter, through one real LiteLLM proxy."""

from __future__ import annotations

from pathlib import Path

import pytest

from fair_sched_plugin.emulator.engine import EmulatorConfig
from fair_sched_plugin.emulator.server import run_emulator

from .litellm_harness import (
    MASTER_KEY,
    litellm_proxy,
    model_entry,
    open_client,
    proxy_config,
    shared_proxy_marks,
)

pytestmark = shared_proxy_marks(pytest.mark.litellm_range)


async def test_a_body_metadata_header_does_not_name_the_user_on_litellm_metadata_routes(
    tmp_path: Path,
) -> None:
    """identity.source header: the trusted gateway in front sets `x-fair-sched-user: bob`. On
    /v1/responses LiteLLM keeps the request's headers in `litellm_metadata` and leaves the body's
    own `metadata` as the client wrote it, so a client that writes `metadata.headers` there
    must not be queued as the user it names."""
    async with run_emulator(EmulatorConfig(models=("tiny",), max_num_seqs=4)) as emu:
        config = proxy_config(
            [model_entry("tiny", f"{emu.base_url}/v1")],
            {
                "identity": {"source": "header"},
                "observability": {"user_labels": "principals"},
                "principals": [
                    {"name": "alice", "match": {"user_id": "nobody-a"}},
                    {"name": "bob", "match": {"user_id": "nobody-b"}},
                ],
            },
        )
        async with (
            litellm_proxy(config, tmp_path) as proxy,
            open_client(proxy.base_url, MASTER_KEY) as client,
        ):
            response = await client.post(
                "/v1/responses",
                json={
                    "model": "tiny",
                    "input": "hi",
                    "max_output_tokens": 4,
                    "metadata": {"headers": {"x-fair-sched-user": "alice"}},
                },
                headers={"x-fair-sched-user": "bob"},
            )
            assert response.headers.get("x-fair-sched-principal") == "bob"
