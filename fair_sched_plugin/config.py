"""The `fair_sched:` settings, validated once at the edge.

Everything downstream receives frozen, typed objects. Errors name the key path and the bad value,
for example ``fair_sched.tiers[1].waiting_below: must be 0 or more (got -1)``.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, NamedTuple, Union, get_args, get_origin
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import ConfigError

__all__ = [
    "AutoBounds",
    "AutoWaitingBelow",
    "BackendSettings",
    "DeploymentSettings",
    "FairSchedSettings",
    "IdentitySettings",
    "MetricsUnavailableSettings",
    "ObservabilitySettings",
    "PlacementSettings",
    "PrincipalMatch",
    "PrincipalSettings",
    "QueueSettings",
    "TierSettings",
    "default_metrics_url",
    "load_settings",
]

_SHA256_KEY = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9_.:@/-]{1,128}$")
# Unknown keys are named in errors only when they look like a setting's name.
_SAFE_KEY = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")


class _Frozen(BaseModel):
    # No infinities or NaNs anywhere: `max_wait_s: .inf` would disable a bound silently.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False, allow_inf_nan=False)


def resolve_secret(value: str | None) -> str | None:
    """A secret as written, or read from the environment for `os.environ/NAME` (LiteLLM's
    convention); None when unset."""
    if value and value.startswith("os.environ/"):
        value = os.environ.get(value.removeprefix("os.environ/"))
    return value or None


def _check_secret_reference(value: str | None) -> str | None:
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


# The fixed threshold a tier gets without one, and where `auto` starts.
_DEFAULT_WAITING_BELOW = 3


class AutoBounds(_Frozen):
    """The range `waiting_below: auto` tunes within."""

    # 0: no engine queue at all where the targets need it (see docs/choosing-thresholds.md).
    min: Annotated[int, Field(ge=0)] = 1
    max: Annotated[int, Field(gt=0, le=10_000)] = 32


class AutoWaitingBelow(_Frozen):
    """`waiting_below: {auto: {min: 1, max: 16}}`."""

    auto: AutoBounds = AutoBounds()


class TierSettings(_Frozen):
    """One priority tier; tiers are listed most urgent first."""

    name: str
    # A number, or `auto` (optionally `{auto: {min, max}}`, or with `waiting_below_min/_max`):
    # the gate then tunes it per model group to keep `ttft_target_ms` and `tpot_below_ms`.
    # 0: no engine queue at all, release only into a running slot the gate counts free.
    waiting_below: Annotated[int, Field(ge=0)] | Literal["auto"] | AutoWaitingBelow = (
        _DEFAULT_WAITING_BELOW
    )
    waiting_below_min: Annotated[int, Field(ge=0)] | None = None
    waiting_below_max: Annotated[int, Field(gt=0, le=10_000)] | None = None
    # Time to first token as the client sees it through us; what `auto` keeps.
    ttft_target_ms: Annotated[float, Field(gt=0, le=600_000)] | None = None
    tpot_below_ms: Annotated[float, Field(gt=0, le=600_000)] | None = None
    kv_usage_below: Annotated[float, Field(gt=0, le=1)] | None = None
    vllm_priority: int = 0
    # Weighted sharing with the adjacent tiers that also have a share (e.g. 0.8 / 0.2); a tier
    # without one keeps strict priority over every tier below it.
    share: Annotated[float, Field(gt=0)] | None = None
    # A request parked this long in this tier moves one tier up (not on the first tier).
    promote_after_s: Annotated[float, Field(gt=0)] | None = None

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("must be 1-128 letters, digits or _.:@/-")
        return value

    @field_validator("waiting_below", mode="before")
    @classmethod
    def _waiting_below_form(cls, value: object) -> object:
        # One clear message instead of one per member of the union.
        if value == "auto":
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)  # as the plain integer field accepted it
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"must be a whole number of requests (got {value})")
            value = int(value)  # YAML's `3.0`
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                raise ValueError(f"must be 0 or more (got {value})")
            return value
        if isinstance(value, Mapping) and set(value) == {"auto"}:
            try:
                return AutoWaitingBelow.model_validate(value)
            except ValidationError as exc:
                first = exc.errors()[0]
                location, message = tuple(first["loc"]), first["msg"]
                if first["type"] == "extra_forbidden":
                    # As `_format_errors` words an unknown key (named only when it looks like one).
                    message = "unknown key"
                    if not _SAFE_KEY.match(str(location[-1])):
                        location = (*location[:-1], "<a key not shown>")
                    elif nearest := _nearest_key(("tiers", 0, "waiting_below", *location)):
                        message += f", did you mean {nearest}?"
                where = ".".join(str(part) for part in location)
                raise ValueError(f"{where}: {message}") from None
        raise ValueError(f"must be a whole number, auto or {{auto: {{min, max}}}} (got {value!r})")

    @model_validator(mode="after")
    def _auto_ok(self) -> TierSettings:
        bounded = self.waiting_below_min is not None or self.waiting_below_max is not None
        if isinstance(self.waiting_below, int):
            if bounded:
                raise ValueError("waiting_below_min/_max: only with waiting_below: auto")
            return self
        if bounded and isinstance(self.waiting_below, AutoWaitingBelow):
            raise ValueError(
                "waiting_below_min/_max: the bounds are already in waiting_below.auto; "
                "give them in one place"
            )
        low, high = self.auto_bounds() or (1, 1)
        if low > high:
            raise ValueError(f"waiting_below: auto needs min <= max (got min {low}, max {high})")
        if self.ttft_target_ms is None and self.tpot_below_ms is None:
            raise ValueError("waiting_below: auto needs ttft_target_ms or tpot_below_ms to aim at")
        return self

    def auto_bounds(self) -> tuple[int, int] | None:
        """(min, max) of `waiting_below: auto`; None for a fixed threshold."""
        value = self.waiting_below
        if isinstance(value, int):
            return None
        if isinstance(value, AutoWaitingBelow):
            return value.auto.min, value.auto.max
        defaults = AutoBounds()
        return (
            self.waiting_below_min if self.waiting_below_min is not None else defaults.min,
            self.waiting_below_max if self.waiting_below_max is not None else defaults.max,
        )

    def initial_waiting_below(self) -> int:
        """The fixed threshold, or where `auto` starts: the fixed default within its bounds.
        From its minimum, slow start behind a lagging proxy (round trips of 1-2 s) spent most
        of a 10 s flood growing 1 -> 12 with the engine's slots idle (issue #17); a first
        interval over the targets shrinks it at once."""
        bounds = self.auto_bounds()
        if bounds is None:
            return int(self.waiting_below)  # type: ignore[arg-type]
        return min(max(_DEFAULT_WAITING_BELOW, bounds[0]), bounds[1])


class PrincipalMatch(_Frozen):
    """Identities issued by LiteLLM's own key management (virtual keys)."""

    user_id: str | None = None
    team_id: str | None = None
    key_alias: str | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> PrincipalMatch:
        if self.user_id is None and self.team_id is None and self.key_alias is None:
            raise ValueError("needs at least one of user_id, team_id, key_alias")
        return self


BUDGET_WINDOWS_S = {"minute": 60.0, "hour": 3600.0, "day": 86400.0}


class BudgetSettings(_Frozen):
    """A spending budget: `usd` (money, in the unit of `backends.<model>.price`) or `tokens`
    per window; over it, `demote` to the tier `demote_to` or `reject` until the window ends."""

    usd: Annotated[float, Field(ge=0)] | None = None
    tokens: Annotated[int, Field(ge=0)] | None = None
    per: Literal["minute", "hour", "day"]
    action: Literal["demote", "reject"] = "reject"
    demote_to: str | None = None

    @model_validator(mode="after")
    def _one_unit(self) -> BudgetSettings:
        if (self.usd is None) == (self.tokens is None):
            raise ValueError("needs exactly one of `usd` or `tokens`")
        if self.action == "demote" and self.demote_to is None:
            raise ValueError("action demote needs `demote_to` (a lower tier)")
        return self


class PrincipalSettings(_Frozen):
    """A named caller: which keys or LiteLLM identities it owns, its tier and weight."""

    name: str
    keys: tuple[str, ...] = ()
    match: PrincipalMatch | None = None
    tier: str | None = None
    # Weights far from 1 would make virtual times overflow or underflow to nothing.
    weight: Annotated[float, Field(ge=0.001, le=1_000_000)] = 1.0
    budget: BudgetSettings | None = None

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("must be 1-128 letters, digits or _.:@/-")
        return value

    @field_validator("keys")
    @classmethod
    def _keys_ok(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        for index, key in enumerate(keys):
            if not key:
                raise ValueError(f"keys[{index}] is empty")
            if key.startswith("sha256:") and not _SHA256_KEY.match(key):
                # The bad value is not echoed: it may be a real key.
                raise ValueError(
                    f"keys[{index}] starts with 'sha256:' but is not 64 lowercase hex digits"
                )
        return keys

    @model_validator(mode="after")
    def _identified(self) -> PrincipalSettings:
        if not self.keys and self.match is None:
            raise ValueError("needs `keys` or `match`")
        return self


class MetricsUnavailableSettings(_Frozen):
    """What the gate does while an engine's metrics cannot be read."""

    max_inflight: Annotated[int, Field(gt=0)] = 4


class PriceSettings(_Frozen):
    """Money per million tokens (`fairness: cost` and `usd` budgets); cached prompt tokens cost
    `cached_input_per_mtok`, or the input price when it is not given."""

    input_per_mtok: Annotated[float, Field(ge=0)]
    cached_input_per_mtok: Annotated[float, Field(ge=0)] | None = None
    output_per_mtok: Annotated[float, Field(ge=0)]

    def cost(self, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> float:
        cached = min(max(cached_tokens, 0), prompt_tokens)
        cached_price = self.input_per_mtok
        if self.cached_input_per_mtok is not None:
            cached_price = self.cached_input_per_mtok
        return (
            (prompt_tokens - cached) * self.input_per_mtok
            + cached * cached_price
            + output_tokens * self.output_per_mtok
        ) / 1_000_000


class PlacementSettings(_Frozen):
    """Where a released request of a model with several deployments goes (core/placement.py)."""

    # Requests whose prompts start alike go where that start went recently (its KV cache is
    # there), as long as that deployment's load stays within `load_bound` times the mean.
    prefix_affinity: bool = True
    load_bound: Annotated[float, Field(gt=1, le=100)] = 1.25


class DeploymentSettings(NamedTuple):
    """One deployment behind a model name: its key and where its engine's metrics are."""

    # The api_base without a trailing "/", or the metrics URL where no api_base is known: the
    # name a lease's `deployment` carries.
    key: str
    metrics_url: str


class BackendSettings(_Frozen):
    """One model group (a LiteLLM `model_name`): where its engine metrics are, what it supports."""

    # Where the OpenAI-compatible API is (`http://host:8000/v1`): used by `fair-sched proxy`,
    # and the default for `metrics_url` (`http://host:8000/metrics`).
    api_base: str | None = None
    # The key `fair-sched proxy` sends to that engine (vLLM's --api-key), plain or
    # `os.environ/NAME`; never logged. Clients' own keys are never forwarded.
    api_key: str | None = Field(default=None, repr=False)
    # Several deployments behind one model name (replicas of one engine), each with its own
    # gate: `api_base` and these together, without duplicates.
    api_bases: tuple[str, ...] = ()
    metrics_url: str | None = None
    # The deployments' metrics URLs: paired with `api_bases` by position, or (without any
    # api_base) each one a deployment of its own.
    metrics_urls: tuple[str, ...] = ()
    placement: PlacementSettings = PlacementSettings()
    engine: Literal["vllm", "sglang", "tgi"] = "vllm"
    priority_scheduling: bool = False
    # SGLang only: the engine was started with --schedule-low-priority-values-first.
    priority_low_values_first: bool = False
    # The engine's own queue serves users in turn too (needs priority_scheduling): a request's
    # priority also counts its user's requests released to that model and not yet streaming, and
    # a user with none may go past the tier's waiting_below by up to the engine's running slots.
    fair_engine_queue: bool = False
    # Metric names that replace the engine profile's, e.g. {"waiting": "my:queue_len"}.
    metric_names: dict[str, str] = Field(default_factory=dict)
    # The engine's `model_name` label to filter on; defaults to none (all series are summed).
    engine_model_name: str | None = None
    # How long a released request may take to reach the engine before a scrape is trusted to
    # include it; until then (or its first byte) it keeps counting against the waiting threshold.
    # A LiteLLM proxy on a busy host can take several hundred ms to forward a request.
    arrival_grace_ms: Annotated[float, Field(ge=0, le=60_000)] = 1000.0
    # Each deployment's running slots (vLLM's --max-num-seqs), when known: free slots count from
    # the first scrape instead of being learned. A queue in a scrape still lowers it (KV full).
    max_num_seqs: Annotated[int, Field(gt=0)] | None = None
    # How far behind the engine's /metrics is (vLLM's can lag seconds under load): a scrape then
    # shows the engine as it was this long before it was sent.
    metrics_lag_ms: Annotated[float, Field(ge=0, le=60_000)] = 0.0
    # Ask the engine for only the series the gate reads where it serves a page filtered by name
    # (vLLM: /metrics/?name[]=...; 2.3 kB instead of 47.5 kB, rendered on the engine's own CPU).
    # An engine that does not is read whole, as with false.
    metrics_filter: bool = True
    on_metrics_unavailable: MetricsUnavailableSettings | None = None
    price: PriceSettings | None = None

    @field_validator("api_key")
    @classmethod
    def _api_key_ok(cls, value: str | None) -> str | None:
        return _check_secret_reference(value)

    def resolved_api_key(self) -> str | None:
        return resolve_secret(self.api_key)

    @field_validator("metric_names")
    @classmethod
    def _metric_names_ok(cls, names: dict[str, str]) -> dict[str, str]:
        allowed = {"waiting", "running", "kv_usage", "tpot"}
        for key in names:
            if key not in allowed:
                raise ValueError(f"unknown signal {key!r}; expected one of {sorted(allowed)}")
        return names

    @field_validator("metrics_url", "api_base")
    @classmethod
    def _url_ok(cls, value: str | None) -> str | None:
        if value is not None:
            _check_http_url(value)
        return value

    @field_validator("metrics_urls", "api_bases")
    @classmethod
    def _urls_ok(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            _check_http_url(value)
        return values

    @model_validator(mode="after")
    def _deployments_pair(self) -> BackendSettings:
        self.deployments()
        return self

    @model_validator(mode="after")
    def _fair_engine_queue_ok(self) -> BackendSettings:
        if self.fair_engine_queue and (not self.priority_scheduling or self.engine == "tgi"):
            raise ValueError(
                "fair_engine_queue: needs priority_scheduling: true on a vllm or sglang engine "
                "(the engine orders its queue by the priority we send)"
            )
        return self

    def with_api_bases(self, api_bases: tuple[str, ...], *, model: str) -> BackendSettings:
        """These settings with the deployments an adapter found (LiteLLM's model_list), validated
        as if configured; errors name the backend's key path."""
        try:
            return BackendSettings.model_validate(
                {**self.model_dump(exclude_unset=True), "api_bases": api_bases}
            )
        except ValidationError as exc:
            message = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
            raise ConfigError(
                f"fair_sched.backends.{model}.{message} (api_bases: the model_list's "
                f"{len(api_bases)} deployments of this model)"
            ) from None

    def all_api_bases(self) -> tuple[str, ...]:
        """Every deployment's api_base without a trailing "/", `api_base` first, no duplicates."""
        bases = ((self.api_base,) if self.api_base else ()) + self.api_bases
        return tuple(dict.fromkeys(deployment_key(base) for base in bases))

    def all_metrics_urls(self) -> tuple[str, ...]:
        """Every deployment's metrics URL, in the order of `deployments()`."""
        return tuple(deployment.metrics_url for deployment in self.deployments())

    def deployments(self) -> tuple[DeploymentSettings, ...]:
        """The deployments behind this model name (the one mapping every adapter uses): each
        api_base with its metrics URL (given by position, or derived from the api_base), or,
        without any api_base, each metrics URL keyed by itself."""
        bases = self.all_api_bases()
        urls = tuple(
            dict.fromkeys(((self.metrics_url,) if self.metrics_url else ()) + self.metrics_urls)
        )
        if not bases:
            return tuple(DeploymentSettings(url, url) for url in urls)
        if not urls:
            derived = tuple(DeploymentSettings(base, default_metrics_url(base)) for base in bases)
            if len({deployment.metrics_url for deployment in derived}) < len(derived):
                raise ValueError(
                    "api_bases: two of them have the same metrics URL; give `metrics_urls`, "
                    "one per api_base in the same order"
                )
            return derived
        if len(urls) == len(bases):
            return tuple(DeploymentSettings(*pair) for pair in zip(bases, urls, strict=True))
        if len(bases) == 1 and not self.api_bases:
            # One `api_base` (where `fair-sched proxy` forwards) in front of several engines
            # whose metrics are listed: the deployments are the engines, known by their metrics.
            return tuple(DeploymentSettings(url, url) for url in urls)
        raise ValueError(
            f"metrics_urls: {len(urls)} metrics URLs for {len(bases)} api_bases; give one per "
            "api_base, in the same order (or none: each is derived from its api_base)"
        )


class QueueSettings(_Frozen):
    max_per_user: Annotated[int, Field(gt=0)] = 1000
    max_total: Annotated[int, Field(gt=0)] = 100_000
    max_wait_s: Annotated[float, Field(gt=0, le=86_400)] = 600.0
    # Inside one user's queue: arrival order, or the smallest expected work (prompt estimate +
    # requested output tokens) first.
    order: Literal["fifo", "shortest_first"] = "fifo"
    # Waiting clients (issue 18): a parked `stream: true` request gets its 200 and SSE headers
    # after `keepalive_after_s` (0: never), then an SSE comment every `keepalive_interval_s`, so
    # idle timeouts of load balancers and client libraries do not cut it while it waits.
    keepalive_after_s: Annotated[float, Field(ge=0, le=86_400)] = 10.0
    keepalive_interval_s: Annotated[float, Field(gt=0, le=3_600)] = 10.0


class IdentitySettings(_Frozen):
    """Where the caller's identity comes from.

    `auth` (default) trusts only authentication: principal keys or LiteLLM's key metadata.
    `header` and `body_user` trust a value the client sends; use them only behind a gateway that
    sets that value itself, because any client can otherwise claim any identity.
    """

    source: Literal["auth", "header", "body_user"] = "auth"
    header: str = "x-fair-sched-user"


DEFAULT_WAIT_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0
)  # fmt: skip


class ObservabilitySettings(_Frozen):
    """The plugin's own metrics and status page (`/fair-sched/metrics`, `/fair-sched/status`).

    `user_labels: principals` adds a `user` label naming configured principals (a bounded set);
    every other caller is counted as `other`. Raw keys and key hashes never become labels.
    `admin_key` guards the endpoints of the standalone proxy and the middleware (plain, or
    `os.environ/NAME` to read it from the environment); LiteLLM uses its own master key.
    """

    user_labels: Literal["none", "principals"] = "none"
    admin_key: str | None = Field(default=None, repr=False)
    # Models without a `backends` entry get their own label value up to this many; then `other`.
    max_model_labels: Annotated[int, Field(gt=0, le=10_000)] = 64
    # Backlogged (and in-flight) principals listed per model on the status page (most first).
    status_max_users: Annotated[int, Field(gt=0, le=100_000)] = 100
    wait_buckets_s: tuple[float, ...] = DEFAULT_WAIT_BUCKETS_S

    @field_validator("wait_buckets_s")
    @classmethod
    def _buckets_ok(cls, buckets: tuple[float, ...]) -> tuple[float, ...]:
        if not buckets:
            raise ValueError("needs at least one bucket")
        if any(bound <= 0 for bound in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError("must be positive and strictly increasing")
        return buckets

    @field_validator("admin_key")
    @classmethod
    def _admin_key_ok(cls, value: str | None) -> str | None:
        return _check_secret_reference(value)

    def resolved_admin_key(self) -> str | None:
        """The admin key, read from the environment for `os.environ/NAME`; None when unset."""
        return resolve_secret(self.admin_key)


class FairSchedSettings(_Frozen):
    tiers: tuple[TierSettings, ...] = (
        TierSettings(name="interactive", waiting_below=3, tpot_below_ms=150, vllm_priority=0),
        TierSettings(name="batch", waiting_below=1, vllm_priority=10),
    )
    default_tier: str | None = None
    fairness: Literal["round_robin", "weighted", "tokens", "cost"] = "round_robin"
    principals: tuple[PrincipalSettings, ...] = ()
    identity: IdentitySettings = IdentitySettings()
    backends: dict[str, BackendSettings] = Field(default_factory=dict)
    queue: QueueSettings = QueueSettings()
    # Graceful drain (issue 18): after SIGTERM, how long started requests may run to their end
    # before they are cut; parked ones are refused at once (503 shutting_down).
    drain_grace_s: Annotated[float, Field(ge=0, le=3_600)] = 30.0
    metrics_poll_ms: Annotated[float, Field(ge=10, le=60_000)] = 100.0
    # Below 10 ms no real engine answers: every scrape would fail and the gate fall back.
    metrics_timeout_ms: Annotated[float, Field(ge=10, le=60_000)] | None = None
    stale_after_ms: Annotated[float, Field(gt=0, le=3_600_000)] | None = None
    on_metrics_unavailable: MetricsUnavailableSettings = MetricsUnavailableSettings()
    # Gate for models that have no `backends` entry and no metrics URL: an in-flight cap.
    unknown_model_max_inflight: Annotated[int, Field(gt=0)] = 64
    # The longest a request may hold its lease (queueing not included): a client that stops
    # reading, or a generation that never ends, gives its engine slot back after this long and
    # its connection is closed.
    max_lease_s: Annotated[float, Field(gt=0, le=86_400)] = 3600.0
    # A client that does not take one chunk of the response for this long is treated as gone.
    send_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    state: str = "memory://"
    # Shared state (`state: redis://...`): key prefix, how often a replica says it is alive, and
    # after how long without a heartbeat its queued tickets and leases are dropped.
    state_prefix: Annotated[str, Field(min_length=1, max_length=64)] = "fair_sched:"
    state_heartbeat_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    state_lease_ttl_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    observability: ObservabilitySettings = ObservabilitySettings()

    @field_validator("tiers")
    @classmethod
    def _tiers_ok(cls, tiers: tuple[TierSettings, ...]) -> tuple[TierSettings, ...]:
        if not tiers:
            raise ValueError("needs at least one tier")
        names = [tier.name for tier in tiers]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate tier names {duplicates}")
        return tiers

    @field_validator("state")
    @classmethod
    def _state_ok(cls, value: str) -> str:
        scheme = value.split("://", 1)[0] if "://" in value else ""
        if scheme not in {"memory", "redis", "rediss"}:
            raise ValueError("must be memory:// or redis://host:port/db (or rediss://)")
        return value

    @model_validator(mode="after")
    def _cross_references(self, info: ValidationInfo) -> FairSchedSettings:
        if self.state_lease_ttl_s < 2 * self.state_heartbeat_s:
            raise ValueError(
                f"state_lease_ttl_s: must be at least twice state_heartbeat_s "
                f"({self.state_heartbeat_s:g}) (got {self.state_lease_ttl_s:g})"
            )
        tier_names = {tier.name for tier in self.tiers}
        if self.tiers[0].promote_after_s is not None:
            raise ValueError("tiers[0].promote_after_s: the first tier has no tier above it")
        priced = any(backend.price is not None for backend in self.backends.values())
        # Inside LiteLLM every deployment may have a price in LiteLLM's own cost data.
        priced = priced or bool((info.context or {}).get(PRICES_FROM_ADAPTER))
        if self.fairness == "cost" and not priced:
            raise ValueError("fairness: cost needs a price in at least one backends.<model>.price")
        if self.default_tier is not None and self.default_tier not in tier_names:
            raise ValueError(f"default_tier: unknown tier; tiers are {sorted(tier_names)}")
        seen_names: set[str] = set()
        seen_keys: dict[str, str] = {}
        for index, principal in enumerate(self.principals):
            where = f"principals[{index}]"
            if principal.tier is not None and principal.tier not in tier_names:
                # The value is not echoed: a key pasted into the wrong field would be printed.
                raise ValueError(f"{where}.tier: unknown tier; tiers are {sorted(tier_names)}")
            budget = principal.budget
            if budget is not None and budget.demote_to is not None:
                order = [tier.name for tier in self.tiers]
                own = principal.tier or self.default_tier_name
                if budget.demote_to not in tier_names:
                    raise ValueError(
                        f"{where}.budget.demote_to: unknown tier {budget.demote_to!r}; "
                        f"tiers are {sorted(tier_names)}"
                    )
                if own in tier_names and order.index(budget.demote_to) <= order.index(own):
                    raise ValueError(
                        f"{where}.budget.demote_to: {budget.demote_to!r} is not below the "
                        f"principal's tier {own!r}"
                    )
            if budget is not None and budget.usd is not None and not priced:
                raise ValueError(f"{where}.budget.usd: needs prices in backends.<model>.price")
            if principal.name in seen_names:
                raise ValueError(f"{where}.name: the same name as an earlier principal")
            seen_names.add(principal.name)
            for key in principal.keys:
                if key in seen_keys:
                    raise ValueError(
                        f"{where}.keys: a key is also listed for principal {seen_keys[key]!r}"
                    )
                seen_keys[key] = principal.name
        return self

    @property
    def default_tier_name(self) -> str:
        return self.default_tier or self.tiers[0].name

    @property
    def effective_stale_after_ms(self) -> float:
        # Long enough that one timed-out scrape does not make the gate fall back.
        return self.stale_after_ms or max(
            10 * self.metrics_poll_ms, 2 * self.effective_metrics_timeout_ms
        )

    @property
    def effective_metrics_timeout_ms(self) -> float:
        # A loaded engine renders /metrics slowly (vLLM on a busy CPU: several hundred ms).
        return self.metrics_timeout_ms or max(1000.0, 5 * self.metrics_poll_ms)

    def tier(self, name: str) -> TierSettings:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)

    def backend(self, model: str) -> BackendSettings | None:
        return self.backends.get(model)


def _check_http_url(value: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise ValueError("must be an http(s) URL")  # not echoed: it may carry a password


def deployment_key(api_base: str) -> str:
    """The key of the deployment at `api_base` (a lease's `deployment`): the api_base without a
    trailing "/". Every adapter maps its deployments to keys with this one function."""
    return api_base.rstrip("/")


def safe_url(url: str) -> str:
    """A URL without credentials, query or fragment (fit for a label, a log or a status page)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:  # a port out of range: nothing of it is shown
        port = None
    netloc = f"{host}:{port}" if port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def deployment_names(keys: Iterable[str]) -> dict[str, str]:
    """Each deployment key's public name: what responses, the status document, metric labels
    and logs call it, since the key (an api_base) may carry a password or a `?token=`.

    The name is the key as `safe_url` shows it (`http://user:pw@h:8000/v1?token=t` ->
    `http://h:8000/v1`); keys that would share a name are told apart by `#1`, `#2`, ... in the
    order given (the configuration's, so every replica names them alike)."""
    unique = list(dict.fromkeys(keys))
    by_name: dict[str, list[str]] = {}
    for key in unique:
        by_name.setdefault(safe_url(key), []).append(key)
    names = {}
    for name, same in by_name.items():
        for number, key in enumerate(same, start=1):
            names[key] = name if len(same) == 1 else f"{name}#{number}"
    return names


def default_metrics_url(api_base: str) -> str:
    """`http://host:8000/v1` -> `http://host:8000/metrics` (LiteLLM's `api_base` to /metrics)."""
    parts = urlsplit(api_base.rstrip("/"))
    path = parts.path
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path.rstrip("/") + "/metrics", "", ""))


def _format_location(location: tuple[int | str, ...]) -> str:
    path = "fair_sched"
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _annotations_at(annotation: Any, part: int | str) -> list[Any]:
    """What `part` of a location reaches inside a value of type `annotation`."""
    found: list[Any] = []
    for kind in _alternatives(annotation):
        origin = get_origin(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            if part in kind.model_fields:
                found.append(kind.model_fields[str(part)].annotation)
        elif origin in (tuple, list) and isinstance(part, int):
            found.extend(arg for arg in get_args(kind) if arg is not Ellipsis)
        elif origin in (dict, Mapping) and isinstance(part, str):
            found.append(get_args(kind)[-1])
    # Pydantic names the member of a union it tried (`...waiting_below.AutoWaitingBelow.auto`).
    members = [kind for kind in _alternatives(annotation) if getattr(kind, "__name__", "") == part]
    return found or members


def _alternatives(annotation: Any) -> list[Any]:
    """`annotation` without `Annotated`, `X | None` split into its members."""
    if get_origin(annotation) is Annotated:
        return _alternatives(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        return [kind for member in get_args(annotation) for kind in _alternatives(member)]
    return [annotation]


def _nearest_key(location: tuple[int | str, ...]) -> str | None:
    """The known key closest to the unknown one at the end of `location` (a typo's fix)."""
    annotations: list[Any] = [FairSchedSettings]
    for part in location[:-1]:
        annotations = [found for kind in annotations for found in _annotations_at(kind, part)]
    known = {
        name
        for annotation in annotations
        for kind in _alternatives(annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel)
        for name in kind.model_fields
    }
    matches = difflib.get_close_matches(str(location[-1]), sorted(known), n=1)
    return matches[0] if matches else None


def _format_errors(error: ValidationError) -> str:
    lines = []
    for detail in error.errors(include_url=False):
        location = tuple(
            part
            for part in detail["loc"]
            if not (isinstance(part, str) and part.startswith("function-"))
        )
        message = detail["msg"].removeprefix("Value error, ")
        kind = detail["type"]
        if kind == "extra_forbidden":
            message = "unknown key"
            nearest = _nearest_key(location) if _SAFE_KEY.match(str(location[-1])) else None
            if nearest is not None:
                message += f", did you mean {nearest}?"
        bad_value = detail.get("input")
        # Only numbers and booleans are echoed: any string may be a key pasted in the wrong
        # place (a name, a URL with a password, a tier), and a config error ends up in logs.
        show_value = kind != "extra_forbidden" and isinstance(bad_value, (int, float))
        if show_value and "(got " not in message:
            message += f" (got {bad_value!r})"
        if kind == "extra_forbidden" and location and not _SAFE_KEY.match(str(location[-1])):
            location = (*location[:-1], "<a key not shown>")
        where = _format_location(location)
        # Cross-field checks raise "sub.path: message" from the model; fold the path in.
        nested = re.match(r"^([A-Za-z_][\w.\[\]]*): (.*)$", message, re.DOTALL)
        if nested and kind == "value_error":
            where, message = f"{where}.{nested.group(1)}", nested.group(2)
        lines.append(f"{where}: {message}")
    return "invalid fair_sched settings:\n  " + "\n  ".join(lines)


# Validation context key: prices come from the adapter (see `parse_settings`).
PRICES_FROM_ADAPTER = "prices_from_adapter"


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
        raise ConfigError(_format_errors(exc)) from None


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
