"""A TCP relay on 127.0.0.1 that drops a connection silent for `idle_s` in both directions.

What a load balancer or a client library's read timeout does to a parked request that hears
nothing: the keep-alive tests put it between the client and the server under test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

LOOPBACK = "127.0.0.1"


class IdleTimeoutRelay:
    """Relays each accepted connection to `target_port`; counts the ones it cut for idleness."""

    def __init__(self, target_port: int, idle_s: float) -> None:
        self._target_port = target_port
        self._idle_s = idle_s
        self.url = ""
        self.dropped = 0
        self.relayed = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        activity: asyncio.Event,
    ) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            activity.set()
            writer.write(data)
            await writer.drain()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.relayed += 1
        upstream_r, upstream_w = await asyncio.open_connection(LOOPBACK, self._target_port)
        activity = asyncio.Event()
        pipes = [
            asyncio.ensure_future(self._pipe(client_r, upstream_w, activity)),
            asyncio.ensure_future(self._pipe(upstream_r, client_w, activity)),
        ]
        try:
            while True:
                activity.clear()
                heard = asyncio.ensure_future(activity.wait())
                try:
                    done, _ = await asyncio.wait(
                        [*pipes, heard], timeout=self._idle_s, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    heard.cancel()
                if not done:
                    self.dropped += 1  # silent for idle_s: cut it, as a balancer would
                    return
                if any(pipe in done for pipe in pipes):
                    return  # one side closed
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            for writer in (client_w, upstream_w):
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
            self._tasks.discard(task)


@contextlib.asynccontextmanager
async def idle_timeout_relay(base_url: str, idle_s: float) -> AsyncIterator[IdleTimeoutRelay]:
    """Yield a relay in front of `base_url` (http://127.0.0.1:PORT); `relay.url` is its URL."""
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    relay = IdleTimeoutRelay(port, idle_s)
    server = await asyncio.start_server(relay._serve, LOOPBACK, 0)
    relay_port = server.sockets[0].getsockname()[1]
    relay.url = f"http://{LOOPBACK}:{relay_port}"
    try:
        yield relay
    finally:
        server.close()
        for task in list(relay._tasks):
            task.cancel()
        await asyncio.gather(*relay._tasks, return_exceptions=True)
        await server.wait_closed()
