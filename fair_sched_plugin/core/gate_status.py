"""What the metrics gate shows: each deployment's mode and numbers, their sums per model group,
and the transitions between modes (for the metrics, the status page, and a leader publishing
them to its followers). Read models only: every decision is the gate's (core/backpressure.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, NamedTuple

GateMode = Literal["starting", "metrics", "fallback"]


class GateTransition(NamedTuple):
    model: str
    old: GateMode
    new: GateMode
    reason: str
    # The deployment whose metrics went stale or came back (its key).
    deployment: str


class DeploymentStatus(NamedTuple):
    """What the gate knows about one deployment (for metrics and the status page)."""

    deployment: str
    mode: GateMode
    waiting: float | None
    running: float | None
    tpot_s: float | None
    kv_usage: float | None
    pending: int
    free_slots: float
    in_flight: int
    last_scrape_age_s: float | None
    blocked_reason: str | None
    # Per tier with `waiting_below: auto`: the engine queue its tuner allows now.
    allowed_queue: tuple[tuple[str, float], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """This row as JSON values keyed by field name (how a leader publishes it)."""
        return {**self._asdict(), "allowed_queue": [list(pair) for pair in self.allowed_queue]}

    @classmethod
    def from_wire(cls, fields: object) -> DeploymentStatus:
        """The row `to_wire` wrote, by name: names a newer replica added are ignored, a field
        added with a default may be missing; ValueError names whatever else is wrong."""
        values = _named_fields(cls, fields)
        values["allowed_queue"] = _allowed_queue(values.get("allowed_queue", ()))
        return cls(**values)


class GroupStatus(NamedTuple):
    """One model group: its deployments' rows and their sums (for metrics and the status page).

    The sums are for reading at a glance; every decision is a deployment's own. `mode` is the
    worst deployment's (fallback, then starting), `blocked_reason` the last decision's when no
    deployment had room (None when one had)."""

    model: str
    mode: GateMode
    deployments: int
    waiting: float | None
    running: float | None
    tpot_s: float | None
    kv_usage: float | None
    pending: int
    free_slots: float
    in_flight: int
    last_scrape_age_s: float | None
    blocked_reason: str | None
    # Per tier with `waiting_below: auto`: the engine queue its tuners allow now (all deployments).
    allowed_queue: tuple[tuple[str, float], ...] = ()
    per_deployment: tuple[DeploymentStatus, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """This group as JSON values keyed by field name, its deployments' rows included."""
        return {
            **self._asdict(),
            "allowed_queue": [list(pair) for pair in self.allowed_queue],
            "per_deployment": [row.to_wire() for row in self.per_deployment],
        }

    @classmethod
    def from_wire(cls, fields: object) -> GroupStatus:
        """The group `to_wire` wrote, by name (see `DeploymentStatus.from_wire`)."""
        values = _named_fields(cls, fields)
        values["allowed_queue"] = _allowed_queue(values.get("allowed_queue", ()))
        rows = values.get("per_deployment", ())
        if not isinstance(rows, list | tuple):
            raise ValueError(f"GroupStatus.per_deployment is not a list: {rows!r:.60}")
        values["per_deployment"] = tuple(DeploymentStatus.from_wire(row) for row in rows)
        return cls(**values)


def _named_fields(cls: type[DeploymentStatus | GroupStatus], fields: object) -> dict[str, Any]:
    if not isinstance(fields, Mapping):
        raise ValueError(
            f"a {cls.__name__} on the wire is an object keyed by field name, not {fields!r:.60}"
        )
    missing = [n for n in cls._fields if n not in fields and n not in cls._field_defaults]
    if missing:
        raise ValueError(f"a {cls.__name__} on the wire lacks {', '.join(missing)}")
    return {name: fields[name] for name in cls._fields if name in fields}


def _allowed_queue(pairs: object) -> tuple[tuple[str, float], ...]:
    if not isinstance(pairs, list | tuple):
        raise ValueError(f"allowed_queue is not a list of [tier, queue] pairs: {pairs!r:.60}")
    return tuple((str(name), float(queue)) for name, queue in pairs)


def group_status(
    model: str, rows: tuple[DeploymentStatus, ...], blocked_reason: str | None
) -> GroupStatus:
    """One group's row from its deployments' rows: sums for reading at a glance, the worst
    deployment's mode (fallback, then starting), tpot and KV usage."""
    fresh = [row for row in rows if row.waiting is not None]
    modes = {row.mode for row in rows}
    mode: GateMode = (
        "fallback" if "fallback" in modes else "starting" if "starting" in modes else "metrics"
    )
    allowed: dict[str, float] = {}
    for row in rows:
        for name, queue in row.allowed_queue:
            allowed[name] = allowed.get(name, 0.0) + queue
    ages = [row.last_scrape_age_s for row in rows if row.last_scrape_age_s is not None]
    return GroupStatus(
        model=model,
        mode=mode,
        deployments=len(rows),
        waiting=sum(row.waiting or 0.0 for row in fresh) if fresh else None,
        running=sum(row.running or 0.0 for row in fresh) if fresh else None,
        tpot_s=_worst(row.tpot_s for row in rows),
        kv_usage=_worst(row.kv_usage for row in rows),
        pending=sum(row.pending for row in rows),
        free_slots=sum(row.free_slots for row in rows),
        in_flight=sum(row.in_flight for row in rows),
        last_scrape_age_s=max(ages) if ages else None,
        blocked_reason=blocked_reason,
        allowed_queue=tuple(allowed.items()),
        per_deployment=rows,
    )


def _worst(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return max(present) if present else None
