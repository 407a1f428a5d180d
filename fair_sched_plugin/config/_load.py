"""Reading the settings: from a mapping, a settings object or a YAML file, validated once."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..errors import ConfigError
from ._messages import format_errors
from ._settings import PRICES_FROM_ADAPTER, FairSchedSettings


def parse_settings(
    section: Mapping[str, Any] | None, *, prices_from_adapter: bool = False
) -> FairSchedSettings:
    """Validate a `fair_sched:` mapping; raise `ConfigError` naming every bad key path.

    `prices_from_adapter`: the adapter knows prices of its own (LiteLLM's cost data), so
    `fairness: cost` and `usd` budgets need no `backends.<model>.price`.
    """
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"fair_sched: must be a mapping (got {type(section).__name__})")
    try:
        return FairSchedSettings.model_validate(
            dict(section), context={PRICES_FROM_ADAPTER: prices_from_adapter}
        )
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, FairSchedSettings)) from None


def load_settings(
    source: str | os.PathLike[str] | Mapping[str, Any] | FairSchedSettings | None = None,
    *,
    prices_from_adapter: bool = False,
) -> FairSchedSettings:
    """Settings from a settings object, a mapping, or a YAML file.

    A file may hold the section at top level under `fair_sched:` (a LiteLLM config) or be the
    section itself. With no source, the file named by `FAIR_SCHED_CONFIG` is read; without that,
    the defaults apply. `prices_from_adapter`: see `parse_settings`.
    """
    if isinstance(source, FairSchedSettings):
        return source
    if source is None:
        env_path = os.environ.get("FAIR_SCHED_CONFIG")
        if not env_path:
            return parse_settings({}, prices_from_adapter=prices_from_adapter)
        source = env_path
    if isinstance(source, Mapping):
        section = source.get("fair_sched", source) if "fair_sched" in source else source
        return parse_settings(section, prices_from_adapter=prices_from_adapter)
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot read fair_sched config file {str(path)!r}: {exc.strerror}"
        ) from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if document is None:
        document = {}
    if not isinstance(document, Mapping):
        raise ConfigError(f"{path}: expected a mapping at top level")
    section = document.get("fair_sched", document)
    # A LiteLLM config without a fair_sched section: use defaults rather than mistaking the
    # whole LiteLLM config for our section.
    if "fair_sched" not in document and (
        "model_list" in document or "litellm_settings" in document
    ):
        section = {}
    return parse_settings(section, prices_from_adapter=prices_from_adapter)
