"""The exceptions fair-sched raises, written out once.

    FairSchedError                    base of everything below
    ├── ConfigError                   invalid `fair_sched` settings (names the key path and value)
    ├── Rejected                      a request the scheduler will not run; carries `retry_after_s`
    │   ├── QueueFull                 per-user or total queue cap reached       -> HTTP 429
    │   ├── DeadlineUnreachable       its predicted start is past its deadline  -> HTTP 429
    │   ├── QueueTimeout              waited longer than `queue.max_wait_s` (or
    │   │                             its `x-fair-sched-max-wait-s`)            -> HTTP 504
    │   ├── BudgetExceeded            the principal spent its budget (reject)   -> HTTP 429
    │   ├── EngineUnavailable         the engine cannot be reached              -> HTTP 502
    │   ├── SchedulerClosed           the scheduler is shutting down            -> HTTP 503
    │   ├── InvalidRequest            a body or model name we will not schedule -> HTTP 400
    │   │   ├── UnknownModel          a model this server does not serve        -> HTTP 404
    │   │   └── BodyTooLarge          a body over the size limit                -> HTTP 413
    │   └── LeaseExpired              held its lease longer than `max_lease_s`  -> HTTP 504
    ├── ClientDisconnected            the client left while its request waited  -> (HTTP 499)
    ├── StateStoreError               the shared state store (Redis) failed; wraps the cause
    └── UnsupportedLiteLLM            the installed LiteLLM's internals differ from what the
                                      LiteLLM adapter hooks into (raised at start-up)

Integrations translate these into HTTP responses with one function
(`fair_sched_plugin.request.responses.error_response`); nothing third-party leaks through the API.
The refusals a waiting client meets are told apart by status and error `code`: queue full
(429 `queue_full`), deadline out of reach (429 `deadline_unreachable`), wait exceeded (504
`timeout`), engine unavailable (502 `upstream_unavailable`) and shutting down (503
`shutting_down`), each with `Retry-After`.
"""

from __future__ import annotations


class FairSchedError(Exception):
    """Base class of every exception raised by fair-sched."""


class ConfigError(FairSchedError, ValueError):
    """The configuration is invalid; the message names the key path and the bad value."""


class Rejected(FairSchedError):
    """The scheduler refuses to run a request.

    `retry_after_s` is a hint for the `Retry-After` header; `status_code` the HTTP status an
    integration should answer with; `reason` a short machine-readable label for metrics and logs.
    """

    status_code = 429
    reason = "rejected"
    # The error `code` clients see; the `reason` label unless a subclass says otherwise.
    code: str | None = None
    # Whether the answer says when to retry (`Retry-After`): not for a request that is wrong
    # as sent, nor for one that already ran.
    retryable = True

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = max(0.0, retry_after_s)

    @property
    def error_code(self) -> str:
        return self.code or self.reason

    @property
    def retry_after_header(self) -> str:
        """`Retry-After` in whole seconds, at least 1."""
        return str(max(1, int(self.retry_after_s + 0.999)))


class QueueFull(Rejected):
    """A per-user or total queue cap was reached."""

    reason = "queue_full"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, scope: str = "user") -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.scope = scope  # "user" or "total"


class DeadlineUnreachable(Rejected):
    """The request cannot start before its deadline (`queue.max_wait_s`, its tier's or its
    client's limit): its place in the queue and the measured drain rate say so, so it is refused
    at once rather than at the deadline (and LiteLLM may send it to a fallback group).
    `waited_s`: how long it had waited (0 when refused on arrival)."""

    reason = "deadline_unreachable"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, waited_s: float = 0.0) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.waited_s = waited_s


class QueueTimeout(Rejected):
    """A request waited longer than `queue.max_wait_s` (or the client's own
    `x-fair-sched-max-wait-s`) without being released: the gateway gave up waiting (504)."""

    status_code = 504
    reason = "timeout"


class BudgetExceeded(Rejected):
    """The principal spent its budget for the current window (`budget.action: reject`);
    `retry_after_s` points at the window's end."""

    reason = "budget"


class SchedulerClosed(Rejected):
    """The scheduler was closed while the request waited (the server is shutting down)."""

    status_code = 503
    reason = "closed"
    code = "shutting_down"


class EngineUnavailable(Rejected):
    """The engine behind a model cannot be reached (refused or reset connections)."""

    status_code = 502
    reason = "engine_unavailable"
    code = "upstream_unavailable"  # what `fair-sched proxy` has always answered


class InvalidRequest(Rejected):
    """The request cannot be scheduled as sent (no model, a list of models, a body too deep).

    Raised before the request is queued, so it never counts as a scheduler rejection.
    """

    status_code = 400
    reason = "invalid_request"
    retryable = False

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, retry_after_s=0.0)
        self.param = param


class UnknownModel(InvalidRequest):
    """The model is not one this server serves (the standalone proxy knows its models)."""

    status_code = 404
    reason = "model_not_found"


class BodyTooLarge(InvalidRequest):
    """The request body is larger than the server reads (refused before it is parsed)."""

    status_code = 413
    reason = "body_too_large"


class LeaseExpired(Rejected):
    """A request held its lease longer than `max_lease_s` (or its client stopped reading)."""

    status_code = 504
    reason = "lease_expired"
    retryable = False


class ClientDisconnected(FairSchedError):
    """The client went away while its request waited; it never reached the engine."""


class StateStoreError(FairSchedError):
    """The shared state store failed; the original exception is the `__cause__`."""


class UnsupportedLiteLLM(FairSchedError, RuntimeError):
    """The installed LiteLLM lacks a hook or internal the adapter relies on; names the version."""
