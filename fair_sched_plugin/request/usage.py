"""What an engine's `usage` says a request cost, read once for every adapter.

The ASGI middleware (and so `fair-sched proxy`) reads `usage` from the response's JSON, the
LiteLLM hooks from LiteLLM's `Usage` objects; both end here, so a lease's `tokens_used` means the
same everywhere: the work the engine did for the request. Prompt tokens the engine served from
its prefix cache (`usage.prompt_tokens_details.cached_tokens`, vLLM with
`--enable-prompt-tokens-details`, OpenAI) were not computed again, so they are not charged: a
user who reuses a prefix is not billed for work the engine did not do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core import request_tokens_in_range


@dataclass(frozen=True)
class Usage:
    """The token counts of one response; None where the engine did not report one."""

    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None
    cached_tokens: int
    """Prompt tokens served from the engine's prefix cache (0 when not reported)."""

    @property
    def tokens_used(self) -> int | None:
        """Uncached prompt tokens plus output tokens: what the `tokens` fairness policy and
        token budgets charge. Falls back to `total_tokens` less the cached ones when prompt or
        output is missing; None when nothing usable was reported."""
        if self.prompt_tokens is not None and self.completion_tokens is not None:
            used = self.prompt_tokens + self.completion_tokens
        elif self.total_tokens is not None:
            used = self.total_tokens
        else:
            return None
        if self.prompt_tokens is not None:
            used -= min(self.cached_tokens, self.prompt_tokens)
        else:
            used -= min(self.cached_tokens, used)
        return used if used > 0 else None


def read_usage(usage: Any) -> Usage | None:
    """`usage` as a JSON object (dict) or an object with attributes (LiteLLM's `Usage`); None
    when it is missing or reports no token count."""
    if usage is None:
        return None
    found = Usage(
        prompt_tokens=_count(usage, "prompt_tokens"),
        completion_tokens=_count(usage, "completion_tokens"),
        total_tokens=_count(usage, "total_tokens"),
        cached_tokens=_count(_field(usage, "prompt_tokens_details"), "cached_tokens") or 0,
    )
    if found.prompt_tokens is None and found.total_tokens is None:
        return None
    return found


def _field(holder: Any, name: str) -> Any:
    if holder is None:
        return None
    if isinstance(holder, Mapping):
        return holder.get(name)
    return getattr(holder, name, None)


def _count(holder: Any, name: str) -> int | None:
    """A token count within the core's range; anything else (a string, a 400-digit integer from
    a misbehaving engine) counts as not reported, so the estimate is charged instead."""
    value = _field(holder, name)
    return value if request_tokens_in_range(value) else None


class JsonUsageFinder:
    """The `usage` of a JSON response body fed in pieces, however large the body.

    OpenAI-style bodies put `usage` after the choices, so a copy of the body's start loses it
    past a few hundred kilobytes (a 46,000-token answer was charged its estimate). Instead each
    piece is searched for the key `"usage"` outside a string (a quote inside a JSON string is
    escaped) followed by `:`, and only a small window after it is kept; the last such object
    that reads as a usage wins (the top-level one comes last among them). O(window) memory.
    """

    WINDOW_BYTES = 4096
    _KEY = b'"usage"'

    def __init__(self) -> None:
        self._carry = b""  # the end of the last piece: a key cut between two pieces
        self._window: bytearray | None = None
        self._found: Usage | None = None

    def feed(self, piece: bytes) -> None:
        window = self._window
        if window is not None and len(window) < self.WINDOW_BYTES:
            window += piece[: self.WINDOW_BYTES - len(window)]
        data = self._carry + piece if self._carry else piece
        at = data.find(self._KEY)
        while at >= 0:
            if at == 0 or data[at - 1] != 0x5C:  # not preceded by a backslash
                self._settle()
                end = at + len(self._KEY)
                self._window = bytearray(data[end : end + self.WINDOW_BYTES])
            at = data.find(self._KEY, at + 1)
        self._carry = data[-(len(self._KEY) - 1) :]

    @property
    def usage(self) -> Usage | None:
        self._settle()
        return self._found

    def _settle(self) -> None:
        window, self._window = self._window, None
        if window is None:
            return
        text = bytes(window).decode("utf-8", "replace").lstrip()
        if not text.startswith(":"):
            return  # a string value "usage", not the key
        try:
            value, _ = json.JSONDecoder().raw_decode(text[1:].lstrip())
        except (ValueError, RecursionError):  # a failing engine's nesting must not end the answer
            return
        found = read_usage(value) if isinstance(value, dict) else None
        if found is not None:
            self._found = found
