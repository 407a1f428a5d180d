"""One HTTP/1.1 GET at a time over one kept-alive connection: what a metrics scrape needs.

A scrape through httpx costs its process 0.6-2 ms of CPU (the client, httpcore's pool, anyio,
h11), ten times a second per engine. Inside LiteLLM that is CPU taken from relaying tokens: about
20 ms a second whatever the traffic, 2-9 % of a busy proxy's CPU per token. A scrape
needs little of HTTP: a GET to a plain `http://` URL, the status, and a body framed by
`Content-Length`, chunks or the connection's end. This does that in a tenth of the CPU; the
watcher keeps httpx for everything else (https, credentials in the URL, a proxy from the
environment, a client it was given).
"""

from __future__ import annotations

import asyncio
import urllib.request

import httpx

__all__ = ["BodyTooLarge", "PlainHttpConnection", "PlainHttpError", "plain_http_reachable"]

# The longest status line plus headers read (an engine's are a few hundred bytes).
MAX_HEAD_BYTES = 64 * 1024
READ_BYTES = 64 * 1024
_HEAD_END = b"\r\n\r\n"
_LINE_END = b"\r\n"


class PlainHttpError(Exception):
    """The exchange failed (network, or an answer that is not HTTP/1.x as read here)."""


class BodyTooLarge(PlainHttpError):
    """The body is larger than the caller's bound."""


def plain_http_reachable(url: httpx.URL) -> bool:
    """Whether `url` can be fetched here as httpx would: plain http, no credentials, and no
    proxy from the environment for its host (httpx honours HTTP_PROXY, ALL_PROXY, NO_PROXY)."""
    if url.scheme != "http" or url.userinfo or not url.host:
        return False
    proxies = urllib.request.getproxies_environment()
    if "http" not in proxies and "all" not in proxies:
        return True
    return bool(urllib.request.proxy_bypass(url.host))


class PlainHttpConnection:
    """GETs to one host and port, one at a time, reusing the connection while the server keeps
    it and it was used within `keepalive_expiry_s` (servers drop idle ones: uvicorn after 5 s).

    No timeout of its own: the caller bounds each `get` (a cancelled one closes the connection).
    """

    def __init__(self, url: httpx.URL, *, keepalive_expiry_s: float) -> None:
        self._host = url.host
        self._port = url.port or 80
        self._keepalive_expiry_s = keepalive_expiry_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._idle_since = 0.0

    async def get(self, url: httpx.URL, max_body_bytes: int) -> tuple[int, bytes]:
        """`url`'s status and body (its host and port are this connection's)."""
        request = b"GET %s HTTP/1.1\r\nHost: %s\r\nAccept: */*\r\n\r\n" % (
            url.raw_path,
            url.netloc,
        )
        loop = asyncio.get_running_loop()
        reused = self._writer is not None
        if reused and (
            loop.time() - self._idle_since > self._keepalive_expiry_s
            or self._reader is None
            or self._reader.at_eof()
        ):
            self.close()
            reused = False
        try:
            try:
                answer = await self._exchange(request, max_body_bytes)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                # A kept connection the server closed as we sent: once more on a new one (a GET
                # has no effect to repeat).
                if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                    raise
                self.close()
                answer = await self._exchange(request, max_body_bytes)
        except BaseException as exc:
            self.close()
            if isinstance(exc, PlainHttpError) or not isinstance(exc, Exception):
                raise  # ours, or a cancellation
            if isinstance(exc, (OSError, EOFError, ValueError, asyncio.LimitOverrunError)):
                # IncompleteReadError is an EOFError; a bad number in the head a ValueError.
                raise PlainHttpError(f"{type(exc).__name__}: {exc}") from None
            raise
        self._idle_since = loop.time()
        return answer

    async def _exchange(self, request: bytes, max_body_bytes: int) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(
                self._host, self._port, limit=MAX_HEAD_BYTES
            )
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(_HEAD_END)
        status_line, *header_lines = head[: -len(_HEAD_END)].split(_LINE_END)
        version, _, rest = status_line.partition(b" ")
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or not rest[:3].isdigit():
            raise PlainHttpError(f"not an HTTP/1.x answer: {status_line[:80]!r}")
        status = int(rest[:3])
        length: int | None = None
        chunked = False
        keep = version == b"HTTP/1.1"
        for line in header_lines:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == b"content-length":
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise PlainHttpError("the answer's Content-Length is not one number")
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.endswith(b"chunked")
                if not chunked:
                    raise PlainHttpError(f"unsupported Transfer-Encoding {value[:40]!r}")
            elif name == b"connection":
                keep = keep and b"close" not in value
        if chunked:
            body = await _read_chunks(reader, max_body_bytes)
        elif length is not None:
            if length > max_body_bytes:
                raise BodyTooLarge(f"body larger than {max_body_bytes} bytes")
            body = await reader.readexactly(length)
        else:
            # Framed by the connection's end (HTTP/1.0 style): never kept.
            keep = False
            read = bytearray()
            while piece := await reader.read(READ_BYTES):
                read += piece
                if len(read) > max_body_bytes:
                    raise BodyTooLarge(f"body larger than {max_body_bytes} bytes")
            body = bytes(read)
        if not keep:
            self.close()
        return status, body

    @property
    def connected(self) -> bool:
        return self._writer is not None

    def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()


async def _read_chunks(reader: asyncio.StreamReader, max_body_bytes: int) -> bytes:
    body = bytearray()
    while True:
        size_line = await reader.readuntil(_LINE_END)
        size = int(size_line.split(b";", 1)[0], 16)  # a ValueError where it is no number
        if size < 0:
            raise PlainHttpError("a chunk of the answer has a negative size")
        if size == 0:
            while await reader.readuntil(_LINE_END) != _LINE_END:
                pass  # trailers, read and dropped
            return bytes(body)
        if len(body) + size > max_body_bytes:
            raise BodyTooLarge(f"body larger than {max_body_bytes} bytes")
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != _LINE_END:
            raise PlainHttpError("a chunk of the answer does not end with CRLF")
