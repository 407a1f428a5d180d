"""HTTP client settings and stream reading shared by everything that talks to an engine."""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator

# Idle pooled connections are dropped well before servers drop them: uvicorn (vLLM, SGLang's
# HTTP server, the emulator) closes an idle keep-alive connection after 5 s, httpx keeps one for
# 5 s by default, and a request sent on a connection the server is closing at that instant fails.
KEEPALIVE_EXPIRY_S = 2.0


_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(pieces: AsyncIterable[str]) -> AsyncIterator[str]:
    """The lines of a Server-Sent Events body (`response.aiter_text()`), ended as the format
    defines it: by CRLF, LF or CR only. httpx's `aiter_lines` also ends a line at U+0085, U+2028
    and U+2029 (`str.splitlines`), which JSON leaves unescaped inside a string, so a generated
    token holding one cut a `data:` line in two (seen with a real vLLM's random-weight model)."""
    buffer = ""
    async for piece in pieces:
        buffer += piece
        start = 0
        for end in _SSE_LINE_END.finditer(buffer):
            if end.group() == "\r" and end.end() == len(buffer):
                break  # maybe the first half of a CRLF: decided with the next piece
            yield buffer[start : end.start()]
            start = end.end()
        buffer = buffer[start:]
    if buffer:
        yield buffer.removesuffix("\r")
