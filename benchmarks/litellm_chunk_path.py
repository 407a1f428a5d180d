"""The plugin's work per streamed chunk inside LiteLLM, in microseconds of CPU, without a network.

What a LiteLLM proxy with the plugin does for every chunk it relays and one without does not:

- LiteLLM's streaming iterator chain (`ProxyLogging.async_post_call_streaming_iterator_hook`)
  with our callback registered, which defines `async_post_call_streaming_iterator_hook`, against
  the same chain with no callback: LiteLLM's own wrapping of an override plus our hook (first
  byte, usage of the chunk);
- the ASGI `send` through the request's `RequestWatch` (a lease held, the send timeout on, as
  inside the proxy) against the server's `send` itself.

Each path relays `--chunks` pydantic chunks (the last carrying `usage`) many times over, on
uvloop as LiteLLM runs; the medians of `--rounds` are printed. Compare the sum with LiteLLM's
own CPU per relayed token (`benchmarks/litellm_cpu.py`, about 800 us on this machine): the
plugin's share per chunk is that ratio.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/litellm_chunk_path.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
from litellm.proxy._types import UserAPIKeyAuth
from litellm.proxy.common_utils.user_api_key_cache import UserApiKeyCache
from litellm.proxy.utils import ProxyLogging
from litellm.types.utils import Delta, ModelResponseStream, StreamingChoices, Usage

from fair_sched_plugin.core import Lease
from fair_sched_plugin.litellm import scheduler
from fair_sched_plugin.request.watch import RequestWatch, ensure_current_request
from fair_sched_plugin.testing import GateLeaseOwner, ManualGate, make_ticket

SEND_TIMEOUT_S = 60.0  # the default `send_timeout_s`


def _lease() -> Lease:
    return Lease(GateLeaseOwner(ManualGate()), make_ticket("u"), 1, 0.0, 0.0, 0.0)


def _chunks(count: int) -> list[ModelResponseStream]:
    token = [StreamingChoices(index=0, delta=Delta(content="tok"))]
    chunks = [ModelResponseStream(id="c", model="tiny", choices=token) for _ in range(count - 1)]
    usage = Usage(prompt_tokens=5, completion_tokens=count - 1, total_tokens=count + 4)
    chunks.append(ModelResponseStream(id="c", model="tiny", choices=[], usage=usage))
    return chunks


async def _iterator_chain(
    logging: ProxyLogging, chunks: list[ModelResponseStream], with_lease: bool
) -> None:
    async def upstream() -> AsyncIterator[ModelResponseStream]:
        for chunk in chunks:
            yield chunk

    lease = _lease()
    if with_lease:
        ensure_current_request().hold(lease)  # in this task's own context
    relayed = 0
    async for _ in logging.async_post_call_streaming_iterator_hook(
        response=upstream(), user_api_key_dict=UserAPIKeyAuth(), request_data={}
    ):
        relayed += 1
    assert relayed == len(chunks)
    assert lease.active != with_lease  # the hook ended the lease it found, with the usage


async def _server_send(message: Any) -> None:
    pass


async def _never_leaves() -> Any:
    await asyncio.Event().wait()


async def _asgi_sends(count: int, watched: bool) -> None:
    send = _server_send
    watch = None
    if watched:
        watch = RequestWatch(_never_leaves, _server_send, send_timeout_s=SEND_TIMEOUT_S)
        watch.hold(_lease())
        send = watch.send
    await send({"type": "http.response.start", "status": 200, "headers": []})
    body = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
    for _ in range(count):
        await send({"type": "http.response.body", "body": body, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    if watch is not None:
        watch.close()


async def _us_per_chunk(
    run: Callable[[], Coroutine[Any, Any, None]], chunks: int, repeat: int
) -> float:
    """CPU microseconds per chunk, each run in a task of its own (its own context)."""
    for _ in range(10):
        await asyncio.create_task(run())
    started = time.process_time()
    for _ in range(repeat):
        await asyncio.create_task(run())
    return (time.process_time() - started) / repeat / chunks * 1e6


async def measure(chunks: int, repeat: int, rounds: int) -> dict[str, list[float]]:
    logging = ProxyLogging(user_api_key_cache=UserApiKeyCache())
    found: dict[str, list[float]] = {}
    stream = _chunks(chunks)
    for _ in range(rounds):
        litellm.callbacks = []
        found.setdefault("iterator chain, no callback", []).append(
            await _us_per_chunk(lambda: _iterator_chain(logging, stream, False), chunks, repeat)
        )
        litellm.callbacks = [scheduler]  # the callback a proxy registers
        found.setdefault("iterator chain, plugin (lease held)", []).append(
            await _us_per_chunk(lambda: _iterator_chain(logging, stream, True), chunks, repeat)
        )
        found.setdefault("ASGI send, the server's", []).append(
            await _us_per_chunk(lambda: _asgi_sends(chunks, False), chunks, repeat)
        )
        found.setdefault("ASGI send, RequestWatch (lease held)", []).append(
            await _us_per_chunk(lambda: _asgi_sends(chunks, True), chunks, repeat)
        )
    litellm.callbacks = []
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=400, help="streams per path and round")
    parser.add_argument("--chunks", type=int, default=58, help="chunks per stream")
    args = parser.parse_args()
    if not 1 <= args.rounds <= 50 or not 1 <= args.repeat <= 100_000:
        parser.error("--rounds must be within 1..50 and --repeat within 1..100000")
    if not 2 <= args.chunks <= 10_000:
        parser.error("--chunks must be within 2..10000")
    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    found = runner(measure(args.chunks, args.repeat, args.rounds))
    medians = {label: statistics.median(values) for label, values in found.items()}
    for label, median in medians.items():
        print(f"{label:42} {median:6.2f} us per chunk (median of {args.rounds} rounds)")
    labels = list(medians)
    iterator = medians[labels[1]] - medians[labels[0]]
    send = medians[labels[3]] - medians[labels[2]]
    print(
        f"\nthe plugin per chunk: iterator chain +{iterator:.2f} us, send +{send:.2f} us, "
        f"{iterator + send:.2f} us in all (uvloop: {runner is not asyncio.run})"
    )


if __name__ == "__main__":
    main()
