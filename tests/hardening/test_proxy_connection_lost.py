"""`fair-sched proxy`'s protocol tells a request that its connection is gone
(`CONNECTION_LOST_EXTENSION`): with several requests on one connection (kept alive, pipelined),
the request now running is the one told, whatever the earlier ones do on their way out. Real
servers on 127.0.0.1, as in `test_request_body_cost`."""

from __future__ import annotations

import asyncio
import json

from ..integrations.conftest import chat_body, wait_until
from .test_request_body_cost import ANSWER_WAIT_S, behind_full_engine, connect


def _post(key: str, body: bytes, *extra: str) -> bytes:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        + "".join(f"{line}\r\n" for line in extra)
        + f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def test_a_pipelined_parked_request_is_withdrawn_when_its_client_leaves() -> None:
    """The first request is refused at once (after it asked to be told of the connection's
    loss); the second, pipelined behind it, parks and asks in turn. The first one's end must not
    take back the second's request: the client leaving withdraws the second from the queue."""
    body = json.dumps(chat_body(user="pipelined")).encode()
    async with behind_full_engine() as (base_url, service, emu):
        reader, writer = await connect(base_url)
        writer.write(_post("sk-a", body, "x-fair-sched-max-wait-s: nan") + _post("sk-a", body))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WAIT_S)
        assert head.startswith(b"HTTP/1.1 400"), head
        await wait_until(lambda: service.scheduler.statistics().queued == 1)
        writer.close()
        await wait_until(lambda: service.scheduler.statistics().queued == 0)
    assert all(request.user != "pipelined" for request in emu.engine.received)
