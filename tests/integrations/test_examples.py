"""The configs in `examples/` do what their headers and the README say, run as a new user would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import emulator
from .litellm_harness import NEEDS_LITELLM, litellm_proxy, open_client, stream_chat

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_MASTER_KEY = "sk-example-master-5d1c"  # as the example's header starts the proxy


def example(name: str) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text(encoding="utf-8"))
    return config


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
