"""The `fair_sched:` section's models: tiers, principals, queue, identity, observability."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..core.fairness_window import DEFAULT_FAIRNESS_WINDOW_S
from ._backends import BackendSettings, MetricsUnavailableSettings
from ._base import Frozen, check_secret_reference, resolve_secret
from ._messages import SAFE_KEY, nearest_key

_SHA256_KEY = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9_.:@/-]{1,128}$")


def _checked_name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError("must be 1-128 letters, digits or _.:@/-")
    return value


# A tier's or principal's name: it appears in logs, metrics labels and the queue document.
Name = Annotated[str, AfterValidator(_checked_name)]
# A model's name as LiteLLM's `model_name` or a backends key (a group's member).
ModelName = Annotated[str, Field(min_length=1, max_length=256)]
# Validation context key: prices come from the adapter (see `parse_settings`).
PRICES_FROM_ADAPTER = "prices_from_adapter"

# The fixed threshold a tier without one and without a TTFT target gets, and where `auto` starts.
_DEFAULT_WAITING_BELOW = 3


class AutoBounds(Frozen):
    """The range `waiting_below: auto` tunes within."""

    # 0: no engine queue at all where the targets need it (see docs/choosing-thresholds.md).
    min: Annotated[int, Field(ge=0)] = 1
    max: Annotated[int, Field(gt=0, le=10_000)] = 32


class AutoWaitingBelow(Frozen):
    """`waiting_below: {auto: {min: 1, max: 16}}`."""

    auto: AutoBounds = AutoBounds()


class TierSettings(Frozen):
    """One priority tier; tiers are listed most urgent first."""

    name: Name
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
    # Running slots that this tier's users who already hold one leave free (tiers below keep
    # them too), so the next user starts at once; needs every backend's max_num_seqs.
    reserve_slots: Annotated[int, Field(ge=0, le=10_000)] = 0
    # How long this tier's requests wait for their turn at most (None: `queue.max_wait_s`, which
    # it may only shorten); a request that cannot start in time is refused at once.
    max_wait_s: Annotated[float, Field(gt=0, le=86_400)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _a_target_means_auto(cls, data: object) -> object:
        # A tier that names the TTFT it wants (or the bounds of `auto`) and no threshold is tuned
        # to that target: a fixed default would leave the target unread. Without a target there
        # is nothing for `auto` to aim at, so such a tier keeps the fixed default
        # (docs/choosing-thresholds.md, "What you get without tuning").
        if (
            isinstance(data, Mapping)
            and "waiting_below" not in data
            and any(
                data.get(key) is not None
                for key in ("ttft_target_ms", "waiting_below_min", "waiting_below_max")
            )
        ):
            return {**data, "waiting_below": "auto"}
        return data

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
                    # As `format_errors` words an unknown key (named only when it looks like one).
                    message = "unknown key"
                    if not SAFE_KEY.match(str(location[-1])):
                        location = (*location[:-1], "<a key not shown>")
                    elif nearest := nearest_key(TierSettings, ("waiting_below", *location)):
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
        of a 10 s flood growing 1 -> 12 with the engine's slots idle; a first
        interval over the targets shrinks it at once."""
        bounds = self.auto_bounds()
        if bounds is None:
            return int(self.waiting_below)  # type: ignore[arg-type]
        return min(max(_DEFAULT_WAITING_BELOW, bounds[0]), bounds[1])


class PrincipalMatch(Frozen):
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


class BudgetSettings(Frozen):
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


class PrincipalSettings(Frozen):
    """A named caller: which keys or LiteLLM identities it owns, its tier and weight."""

    name: Name
    keys: tuple[str, ...] = ()
    match: PrincipalMatch | None = None
    tier: str | None = None
    # Weights far from 1 would make virtual times overflow or underflow to nothing.
    weight: Annotated[float, Field(ge=0.001, le=1_000_000)] = 1.0
    budget: BudgetSettings | None = None

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


class QueueSettings(Frozen):
    max_per_user: Annotated[int, Field(gt=0)] = 1000
    max_total: Annotated[int, Field(gt=0)] = 100_000
    # The request bodies waiting requests hold in this process, per user and in all (bytes).
    max_bytes_per_user: Annotated[int, Field(gt=0)] = 256 * 1024 * 1024
    max_bytes_total: Annotated[int, Field(gt=0)] = 1024 * 1024 * 1024
    max_wait_s: Annotated[float, Field(gt=0, le=86_400)] = 600.0
    # Inside one user's queue: arrival order, or the smallest expected work (prompt estimate +
    # requested output tokens) first.
    order: Literal["fifo", "shortest_first"] = "fifo"
    # Waiting clients: a parked `stream: true` request gets its 200 and SSE headers
    # after `keepalive_after_s` (0: never), then an SSE comment every `keepalive_interval_s`, so
    # idle timeouts of load balancers and client libraries do not cut it while it waits.
    keepalive_after_s: Annotated[float, Field(ge=0, le=86_400)] = 10.0
    keepalive_interval_s: Annotated[float, Field(gt=0, le=3_600)] = 10.0


class IdentitySettings(Frozen):
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


class ObservabilitySettings(Frozen):
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
    # The sliding window of the fairness gauges (Jain's index, the service gap, the starved
    # wait): service is compared between now and about this long ago.
    fairness_window_s: Annotated[float, Field(gt=0, le=86_400)] = DEFAULT_FAIRNESS_WINDOW_S

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
        return check_secret_reference(value)

    def resolved_admin_key(self) -> str | None:
        """The admin key, read from the environment for `os.environ/NAME`; None when unset."""
        return resolve_secret(self.admin_key)


class FairSchedSettings(Frozen):
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
    # Graceful drain: after SIGTERM, how long started requests may run to their end
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
    # `fair-sched proxy`: a request's headers must arrive within this long of its first byte,
    # its body within this long of its headers; then the connection is closed (nginx's
    # client_header_timeout and client_body_timeout).
    read_headers_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    read_body_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # Inside LiteLLM: at its first request, collect once and freeze (`gc.freeze`) the start-up
    # heap, so that a full collection no longer stops the proxy for ~0.45 s (docs/operations.md).
    freeze_startup_heap: bool = True
    state: str = "memory://"
    # Shared state (`state: redis://...`): key prefix, how often a replica says it is alive, and
    # after how long without a heartbeat its queued tickets and leases are dropped.
    state_prefix: Annotated[str, Field(min_length=1, max_length=64)] = "fair_sched:"
    state_heartbeat_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    state_lease_ttl_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    # One leader decides for every model, or each model group elects its own (docs/redis.md);
    # groups of models that share a leader (with `per_model`; a model not listed is its own).
    state_leadership: Literal["one", "per_model"] = "one"
    state_model_groups: dict[Name, tuple[ModelName, ...]] = Field(default_factory=dict)
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
        self._check_model_groups()
        tier_names = {tier.name for tier in self.tiers}
        if self.tiers[0].promote_after_s is not None:
            raise ValueError("tiers[0].promote_after_s: the first tier has no tier above it")
        self._check_reservations()
        for index, tier in enumerate(self.tiers):
            if tier.max_wait_s is not None and tier.max_wait_s > self.queue.max_wait_s:
                raise ValueError(
                    f"tiers[{index}].max_wait_s: at most queue.max_wait_s "
                    f"({self.queue.max_wait_s:g}) (got {tier.max_wait_s:g})"
                )
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

    def _check_reservations(self) -> None:
        for index, tier in enumerate(self.tiers):
            if not tier.reserve_slots:
                continue
            where = f"tiers[{index}].reserve_slots"
            if any(other.share is not None for other in self.tiers):
                raise ValueError(f"{where}: not with tier shares (share)")
            for model, backend in self.backends.items():
                if backend.max_num_seqs is None:
                    raise ValueError(
                        f"{where}: needs backends.{model}.max_num_seqs (the engine's running "
                        "slots, which the reservation is kept out of)"
                    )
                if tier.reserve_slots >= backend.max_num_seqs:
                    raise ValueError(
                        f"{where}: must be below backends.{model}.max_num_seqs "
                        f"({backend.max_num_seqs}) (got {tier.reserve_slots})"
                    )

    def _check_model_groups(self) -> None:
        if self.state_model_groups and self.state_leadership != "per_model":
            raise ValueError("state_model_groups: needs state_leadership: per_model")
        seen: dict[str, str] = {}
        for group, models in self.state_model_groups.items():
            where = f"state_model_groups.{group}"
            if not models:
                raise ValueError(f"{where}: needs at least one model")
            for model in models:
                if model in seen:
                    raise ValueError(f"{where}: model {model!r} is also in group {seen[model]!r}")
                seen[model] = group
            outside = self.backends.keys() - set(models)
            if group in outside:
                raise ValueError(
                    f"{where}: the name of backends.{group}, a model outside the group (each "
                    "model not in a group leads a group of its own, named after it)"
                )

    def leadership_groups(self, models: Iterable[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The model groups that elect their own leaders, home group first: with
        `state_leadership: one`, none (one leader for every model); with `per_model`, the
        groups `state_model_groups` lists, then every other model in `models` on its own (in
        sorted order, so that replicas with the same models agree)."""
        if self.state_leadership == "one":
            return ()
        listed = list(self.state_model_groups.items())
        grouped = {model for _, members in listed for model in members}
        names = {group for group, _ in listed}
        for model in sorted(set(models) - grouped):
            if model in names:
                raise ValueError(
                    f"state_model_groups.{model}: the name of model {model!r}, outside the group"
                )
            listed.append((model, (model,)))
        return tuple(listed)

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
