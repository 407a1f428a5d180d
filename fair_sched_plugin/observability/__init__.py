"""Operator visibility: Prometheus metrics, the status document, their endpoints and a live page.

Every `SchedulingService` has one `ServiceMetrics` (``service.observability``) with its own
`CollectorRegistry`: several services can live in one process and nothing is registered in
prometheus_client's global registry unless asked (`register_in_default_registry`, done for a
LiteLLM proxy so the families also appear in LiteLLM's own ``/metrics``).

Observability reads the service only through `ServiceView` (a small read-only protocol, which the
service's `ServiceReadModel` implements from the parts the service hands over) and is told about
admissions, rejections and gate transitions through its `RequestRecorder`; it imports nothing
from the service. The parts:
the collector (metric families only), the status document, the admin endpoints that serve both,
and the ``/fair-sched/ui`` page that polls the status. The LiteLLM proxy's routes are installed
by the LiteLLM adapter (`fair_sched_plugin.litellm`).

Users become labels only with ``observability.user_labels: principals``, and then only the
configured principals' names (a bounded set); every other caller is ``other``. Keys, key hashes
and key fingerprints never become labels. The status document names callers by principal name
(strangers by a key fingerprint), never by key.
"""

from __future__ import annotations

from ..config import safe_url
from ._collector import FairSchedCollector
from ._endpoints import (
    ADMIN_PATHS,
    METRICS_PATH,
    STATUS_PATH,
    UI_PATH,
    admin_app,
    endpoints,
    keys_match,
)
from ._metrics import ServiceMetrics, register_in_default_registry
from ._read_model import ServiceReadModel
from ._recorder import REJECTION_REASONS, RequestRecorder, rejection_reason
from ._view import BudgetStanding, DeploymentReading, ServiceView

__all__ = [
    "ADMIN_PATHS",
    "METRICS_PATH",
    "REJECTION_REASONS",
    "STATUS_PATH",
    "UI_PATH",
    "BudgetStanding",
    "DeploymentReading",
    "FairSchedCollector",
    "RequestRecorder",
    "ServiceMetrics",
    "ServiceReadModel",
    "ServiceView",
    "admin_app",
    "endpoints",
    "keys_match",
    "register_in_default_registry",
    "rejection_reason",
    "safe_url",
]
