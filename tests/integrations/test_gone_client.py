"""A client that resets its connection mid-stream is not written to any more.

An app relaying buffered chunks calls the server's send() in a tight loop; uvicorn's send does
not wait while the socket takes data, so the loop never turns and the reset is not noticed:
asyncio then logs "socket.send() raised exception." for every write after the fifth (hundreds
of lines in the soak). The request watch gives the loop a turn every few chunks.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Any

import pytest

from fair_sched_plugin.asgi import FairSchedulerMiddleware

from .conftest import LOOPBACK, serve

CHUNKS = 3000


async def tight_streamer(scope: Any, receive: Any, send: Any) -> None:
    """Streams many chunks without ever waiting for anything but send()."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    while (await receive()).get("more_body", False):
        pass
    await send(
        {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"text/event-stream")]}
    )  # fmt: skip
    chunk = b"data: " + b"x" * 4000 + b"\n\n"
    for _ in range(CHUNKS):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def reset_after_first_bytes(port: int) -> None:
    """POST a streamed request, read a little, then close with RST (SO_LINGER 0)."""
    body = b'{"model": "tiny", "messages": [], "stream": true}'
    with socket.create_connection((LOOPBACK, port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-a\r\n"
            b"content-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        sock.recv(1024)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def test_no_writes_pile_up_on_a_reset_connection(caplog: pytest.LogCaptureFixture) -> None:
    app = FairSchedulerMiddleware(tight_streamer, {"unknown_model_max_inflight": 4})
    async with serve(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            for _ in range(3):
                await asyncio.to_thread(reset_after_first_bytes, port)
            service = app.service
            loop = asyncio.get_running_loop()
            give_up_at = loop.time() + 30
            while service.scheduler.statistics().in_flight:
                assert loop.time() < give_up_at
                await asyncio.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if "socket.send()" in r.getMessage()]
    assert lines == []
