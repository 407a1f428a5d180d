"""What every settings model shares: frozen, no extra keys, no infinities; secret references."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    # No infinities or NaNs anywhere: `max_wait_s: .inf` would disable a bound silently.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False, allow_inf_nan=False)


def resolve_secret(value: str | None) -> str | None:
    """A secret as written, or read from the environment for `os.environ/NAME` (LiteLLM's
    convention); None when unset."""
    if value and value.startswith("os.environ/"):
        value = os.environ.get(value.removeprefix("os.environ/"))
    return value or None


def check_secret_reference(value: str | None) -> str | None:
    # A secret named by `os.environ/NAME` must be there when the settings are read: an unset one
    # would otherwise silently leave an endpoint open or a backend unauthenticated.
    if value is not None and value.startswith("os.environ/"):
        name = value.removeprefix("os.environ/")
        if not name:
            raise ValueError("os.environ/ needs a variable name")
        if not os.environ.get(name):
            raise ValueError(f"the environment variable {name} is not set (or empty)")
    elif value is not None and not value:
        raise ValueError("is empty")
    return value
