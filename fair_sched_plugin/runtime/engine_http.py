"""HTTP client settings and stream reading shared by everything that talks to an engine."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterable, AsyncIterator

import httpx

from ..config import safe_url

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


class _UrlRedactingFilter(logging.Filter):
    """Shows the URLs in httpx's own log records (`HTTP Request: POST <url> ...`, at INFO) as
    `safe_url` does: an engine's api_base or metrics URL may carry a password or a `?token=`."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(arg, httpx.URL) for arg in args):
            record.args = tuple(
                safe_url(str(arg)) if isinstance(arg, httpx.URL) else arg for arg in args
            )
        return True


_URL_FILTER = _UrlRedactingFilter()
_url_filter_users = 0


def hide_url_secrets_in_httpx_logs(hide: bool) -> None:
    """Install (True) or release (False) the filter on httpx's logger; installed while any
    user that asked for it has not released it."""
    global _url_filter_users
    _url_filter_users += 1 if hide else -1
    if _url_filter_users > 0:
        logging.getLogger("httpx").addFilter(_URL_FILTER)
    else:
        _url_filter_users = 0
        logging.getLogger("httpx").removeFilter(_URL_FILTER)
