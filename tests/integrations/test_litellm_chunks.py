"""Reading `usage` off LiteLLM's streamed chunks without pydantic's missing-attribute path."""

from __future__ import annotations

import timeit
from types import SimpleNamespace

import pytest

from .litellm_harness import NEEDS_LITELLM

pytestmark = [
    NEEDS_LITELLM,
    # LiteLLM's own types, the first time pydantic builds a chunk's schema in a process (the
    # order of a whole run decides which test that is): not ours to fix.
    pytest.mark.filterwarnings("ignore:Item .* is using the `ReadOnly` qualifier:UserWarning"),
]


def test_chunk_usage_reads_what_getattr_reads() -> None:
    from litellm.types.utils import ModelResponseStream, Usage

    from fair_sched_plugin.litellm._callback import chunk_usage

    usage = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    token = ModelResponseStream(choices=[{"index": 0, "delta": {"content": "x"}}])
    last = ModelResponseStream(choices=[], usage=usage)
    later = ModelResponseStream(choices=[])
    later.usage = usage  # set the way LiteLLM's stream wrapper sets it
    for chunk in (token, last, later, SimpleNamespace(usage=usage), SimpleNamespace(), {}):
        assert chunk_usage(chunk) == getattr(chunk, "usage", None)
    assert chunk_usage(last) == usage


def test_chunk_usage_of_a_token_chunk_is_cheaper_than_getattr() -> None:
    """An ordering (about 40x apart), not a time bound: the direct read raises nothing."""
    from litellm.types.utils import ModelResponseStream

    from fair_sched_plugin.litellm._callback import chunk_usage

    token = ModelResponseStream(choices=[{"index": 0, "delta": {"content": "x"}}])
    direct = min(timeit.repeat(lambda: chunk_usage(token), number=2000, repeat=5))
    through_pydantic = min(
        timeit.repeat(lambda: getattr(token, "usage", None), number=2000, repeat=5)
    )
    if direct >= through_pydantic:
        pytest.fail(f"chunk_usage {direct:.4f} s >= getattr {through_pydantic:.4f} s")
