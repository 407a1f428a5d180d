"""What the request path records for observability: waits, rejections, gate transitions.

The only cost on the request path: one histogram bucket increment per admission, a counter bump
and a bounded ring entry per rejection. Everything else is read from the `ServiceView` at
scrape time. Thread-safe: LiteLLM scrapes from a worker thread.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from ..core import GateTransition, Ticket
from ..errors import QueueFull, Rejected
from ._view import Admitted

if TYPE_CHECKING:
    from ..request.identity import Principal

OTHER = "other"
REJECTION_REASONS = (
    "queue_full_user",
    "queue_full_total",
    "deadline_unreachable",
    "timeout",
    "closed",
)
# Rejections remembered for the status document (newest first there).
RECENT_REJECTIONS = 50


def rejection_reason(exc: Rejected) -> str:
    """A short label for a rejection: queue_full_user, queue_full_total, deadline_unreachable,
    timeout or closed (or another `Rejected.reason`)."""
    if isinstance(exc, QueueFull):
        return f"queue_full_{exc.scope}"
    return exc.reason


class RecentRejection(NamedTuple):
    at: float  # the recorder's clock
    model: str
    tier: str
    user: str  # principal name (a key fingerprint for strangers), never a key
    reason: str


class WaitHistogram:
    """A labelled histogram kept as plain counts, emitted by the collector (no global state)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        # labels -> per-bucket counts (non-cumulative, +Inf last) and the sum
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self.counts.get(labels)
        if counts is None:
            counts = self.counts[labels] = [0] * (len(self.bounds) + 1)
            self.sums[labels] = 0.0
        counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sums[labels] += value

    def copy(self) -> list[tuple[tuple[str, ...], list[int], float]]:
        return [(labels, list(counts), self.sums[labels]) for labels, counts in self.counts.items()]


class Labels:
    """Label values: configured models always, others up to a bound, then `other`; users only
    with ``user_labels: principals`` and then only configured principals' names."""

    def __init__(
        self,
        *,
        configured_models: frozenset[str],
        principal_names: frozenset[str],
        user_labels: bool,
        max_model_labels: int,
    ) -> None:
        self.configured_models = configured_models
        self.user_labels = user_labels
        self._principal_names = principal_names
        self._max_model_labels = max_model_labels
        self._extra_models: set[str] = set()
        self._lock = threading.Lock()

    def model(self, model: str) -> str:
        if model in self.configured_models or model in self._extra_models:
            return model
        with self._lock:
            if len(self._extra_models) < self._max_model_labels:
                self._extra_models.add(model)
                return model
        return OTHER

    def user(self, principal_name: str) -> str:
        return principal_name if principal_name in self._principal_names else OTHER

    def for_ticket(self, ticket: Ticket, *extra: str) -> tuple[str, ...]:
        labels = (self.model(ticket.model), ticket.tier, *extra)
        return (*labels, self.user(ticket.user)) if self.user_labels else labels


class RequestRecorder:
    """An `AdmissionObserver` and a gate transition listener; `copy_*` for the readers."""

    def __init__(
        self,
        labels: Labels,
        wait_buckets_s: Sequence[float],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.labels = labels
        self.clock = clock
        self._lock = threading.Lock()
        self._wait = WaitHistogram(wait_buckets_s)
        self._rejected: dict[tuple[str, ...], int] = {}
        self._recent: deque[RecentRejection] = deque(maxlen=RECENT_REJECTIONS)
        self._transitions: dict[tuple[str, str, str], int] = {}
        self._read_timeouts: dict[str, int] = {}

    @property
    def wait_bounds(self) -> tuple[float, ...]:
        return self._wait.bounds

    def admitted(self, admission: Admitted) -> None:
        lease = admission.lease
        labels = self.labels.for_ticket(lease.ticket)
        with self._lock:
            self._wait.observe(labels, max(0.0, lease.released_at - lease.enqueued_at))

    def rejected(self, principal: Principal, ticket: Ticket, error: Rejected) -> None:
        reason = rejection_reason(error)
        labels = self.labels.for_ticket(ticket, reason)
        recent = RecentRejection(self.clock(), ticket.model, ticket.tier, principal.name, reason)
        with self._lock:
            self._rejected[labels] = self._rejected.get(labels, 0) + 1
            self._recent.append(recent)

    def gate_transition(self, transition: GateTransition) -> None:
        key = (transition.model, transition.old, transition.new)
        with self._lock:
            self._transitions[key] = self._transitions.get(key, 0) + 1

    def read_timed_out(self, phase: str) -> None:
        """A connection closed because its request's headers or body came too slowly."""
        with self._lock:
            self._read_timeouts[phase] = self._read_timeouts.get(phase, 0) + 1

    def copy_read_timeouts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._read_timeouts)

    def copy_rejected(self) -> dict[tuple[str, ...], int]:
        with self._lock:
            return dict(self._rejected)

    def copy_recent_rejections(self) -> list[RecentRejection]:
        with self._lock:
            return list(self._recent)

    def copy_waits(self) -> list[tuple[tuple[str, ...], list[int], float]]:
        with self._lock:
            return self._wait.copy()

    def copy_transitions(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            return dict(self._transitions)
