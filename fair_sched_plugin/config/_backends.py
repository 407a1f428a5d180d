"""`backends.<model>`: where a model's deployments and their engine metrics are, and its price."""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

from pydantic import Field, ValidationError, field_validator, model_validator

from ..errors import ConfigError
from ._base import Frozen, check_secret_reference, resolve_secret
from ._urls import check_http_url, default_metrics_url, deployment_key


class MetricsUnavailableSettings(Frozen):
    """What the gate does while an engine's metrics cannot be read."""

    max_inflight: Annotated[int, Field(gt=0)] = 4


class PriceSettings(Frozen):
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


class PlacementSettings(Frozen):
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


class BackendSettings(Frozen):
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
        return check_secret_reference(value)

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
            check_http_url(value)
        return value

    @field_validator("metrics_urls", "api_bases")
    @classmethod
    def _urls_ok(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            check_http_url(value)
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
