"""`ServiceMetrics`: one service's recorder, collector, registry and status document together."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from ._collector import FairSchedCollector
from ._recorder import Labels, RequestRecorder
from ._status import StatusDocument
from ._view import ServiceView, ViewReader


class ServiceMetrics:
    """The metrics and status of one service (``service.observability``).

    `recorder` is what the service tells about admissions, rejections and gate transitions;
    `registry` holds only this service's `collector`; `render()` is the text exposition,
    `status()` the JSON-ready status document. Everything else is read from `view`. `clock`
    dates rejections for the status document's `recent_rejections` ages.
    """

    def __init__(self, view: ServiceView, *, clock: Callable[[], float] = time.monotonic) -> None:
        settings = view.settings
        self._reader = ViewReader(view)
        self.recorder = RequestRecorder(
            Labels(
                configured_models=view.configured_models() | frozenset(view.gated_models()),
                principal_names=frozenset(p.name for p in settings.principals),
                user_labels=settings.observability.user_labels == "principals",
                max_model_labels=settings.observability.max_model_labels,
            ),
            settings.observability.wait_buckets_s,
            clock=clock,
        )
        self.collector = FairSchedCollector(
            self._reader, self.recorder, view.tier_limits(), frozenset(view.gated_models())
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._status = StatusDocument(view, self._reader, self.recorder)

    @property
    def view(self) -> ServiceView:
        """What these metrics and the status read (the service's `ServiceReadModel`)."""
        return self._reader.view

    @property
    def user_labels(self) -> bool:
        return self.recorder.labels.user_labels

    def remember_loop(self) -> None:
        """Note the running loop: scrapes from other threads read the state there."""
        self._reader.remember_loop()

    def render(self) -> bytes:
        """The Prometheus text exposition of this service's metrics."""
        return generate_latest(self.registry)

    def status(self) -> dict[str, Any]:
        """The status document (see docs/operations.md)."""
        return self._status.build()


def register_in_default_registry(metrics: ServiceMetrics) -> bool:
    """Add the service's collector to prometheus_client's global `REGISTRY` (where LiteLLM's
    own /metrics reads); True if added, False if it (or another fair_sched collector) is
    already there."""
    try:
        REGISTRY.register(metrics.collector)
    except ValueError:
        return False
    return True
