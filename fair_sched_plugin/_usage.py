"""What an engine's `usage` says a request cost, read once for every adapter.

The ASGI middleware (and so `fair-sched proxy`) reads `usage` from the response's JSON, the
LiteLLM hooks from LiteLLM's `Usage` objects; both end here, so a lease's `tokens_used` means the
same everywhere: the work the engine did for the request. Prompt tokens the engine served from
its prefix cache (`usage.prompt_tokens_details.cached_tokens`, vLLM with
`--enable-prompt-tokens-details`, OpenAI) were not computed again, so they are not charged: a
user who reuses a prefix is not billed for work the engine did not do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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
    value = _field(holder, name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
