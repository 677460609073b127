"""A read-only view of the owner for metrics and diagnosis.

``owner.observer().snapshot()`` returns an immutable :class:`ObserverSnapshot`:
phase, whether preparation passed, per-connection query counts and
latencies, invalid-record counts, evidence age per observed service, the
snapshot/task budgets in use, each registration's current state
(:class:`RegistrationMetrics`, judged under the current identity epoch) and
the registration report. Labels are only configured names (connection
names, service aliases, registration names) and closed sets of states: no
addresses, no instance ids, no credentials, no metadata. ``prepared`` means
initial preparation passed, not that every instance is healthy.

A :class:`RuntimeObserver` holds no close rights: it only reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from ._capacity import CapacityUse
from ._connection import LATENCY_BUCKETS
from ._evidence import Refusal
from ._registration_state import HealthEvidence, RegistrationState, WriteOutcome

if TYPE_CHECKING:
    from ._owner import DiscoveryOwner, Phase

__all__ = [
    "ConnectionMetrics",
    "ObserverSnapshot",
    "RegistrationMetrics",
    "RuntimeObserver",
    "ServiceMetrics",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServiceMetrics:
    """One observed service of one connection."""

    service: str
    #: Seconds since the last complete listing (None: none yet).
    evidence_age: float | None
    #: None when usable (non-strict) now; otherwise the refusal reason.
    unavailable_reason: str | None
    #: Instances served now (0 when unavailable).
    instances: int
    #: Live Observation handles.
    holders: int
    queries: int
    #: The latest listing's confirmed invalid records as (registry key,
    #: reason), sorted: never served. Diagnostic only; registry keys are not
    #: configured names, so a metrics export must not use them as labels.
    invalid_records: tuple[tuple[str, str], ...] = ()
    #: The evidence kind of the listing served now (None when unavailable).
    evidence: str | None = None
    #: The listing served now is weaker evidence (``EvidenceKind.weak``, e.g.
    #: a Nacos answer past the protect threshold): strict reads refuse it.
    weak: bool = False


@dataclass(frozen=True, slots=True)
class ConnectionMetrics:
    """Counters of one named connection."""

    name: str
    #: None: not prepared yet; True/False: the outcome of prepare.
    prepared: bool | None
    queries: int
    failures: int
    latency_last: float
    latency_avg: float
    latency_max: float
    #: (upper bound in seconds, count) per bucket; the last bound is inf.
    latency_histogram: tuple[tuple[float, int], ...]
    invalid_records: int
    capacity_rejections: int
    #: Times an observation saw this connection's identity revoked.
    identity_revocations: int
    services: tuple[ServiceMetrics, ...]


@dataclass(frozen=True, slots=True)
class RegistrationMetrics:
    """One registration's state: configured names and closed sets only."""

    #: The registration's configured name.
    name: str
    #: The connection it publishes on.
    qualifier: str
    state: RegistrationState
    write: WriteOutcome
    health: HealthEvidence
    eligible: bool
    #: The connection's identity epoch the evidence is judged under.
    epoch: int
    #: An earlier write may still land (never cleared).
    residual_risk: bool
    startup_required: bool
    readiness_critical: bool


@dataclass(frozen=True, slots=True)
class ObserverSnapshot:
    """The owner's state at ``taken_at`` (event-loop clock)."""

    taken_at: float
    phase: Phase
    prepared: bool
    connections: tuple[ConnectionMetrics, ...]
    capacity: CapacityUse
    #: Tasks of the owner alive now.
    live_tasks: int
    #: The registration component's close report (outcome per registration).
    registrations: tuple[object, ...]
    #: Each registration's current state, in plan order.
    registration_states: tuple[RegistrationMetrics, ...] = ()

    def connection(self, name: str) -> ConnectionMetrics:
        for item in self.connections:
            if item.name == name:
                return item
        raise KeyError(name)

    def registration(self, name: str) -> RegistrationMetrics:
        for item in self.registration_states:
            if item.name == name:
                return item
        raise KeyError(name)


class RuntimeObserver:
    """Reads the owner's state. No close rights."""

    __slots__ = ("_read",)

    def __init__(self, owner: DiscoveryOwner) -> None:
        # Keep only a reading function, not the owner itself.
        self._read: Callable[[float], ObserverSnapshot] = _reader(owner)

    def snapshot(self) -> ObserverSnapshot:
        """An immutable record of the owner's state now."""
        return self._read(anyio.current_time())

    def __repr__(self) -> str:
        return "<RuntimeObserver>"


def _reader(owner: DiscoveryOwner) -> Callable[[float], ObserverSnapshot]:
    def read(now: float) -> ObserverSnapshot:
        runtime = owner._runtime
        connections = []
        for name, connection in owner._connections.items():
            stats = connection.stats
            services = []
            for alias, slot in sorted(connection.slots.items()):
                confirmed = slot.evidence.confirmed_at
                view = slot.evidence.view(now)
                services.append(
                    ServiceMetrics(
                        service=alias,
                        evidence_age=None if confirmed is None else max(0.0, now - confirmed),
                        unavailable_reason=(
                            view.reason.value if isinstance(view, Refusal) else None
                        ),
                        instances=0 if isinstance(view, Refusal) else len(view.instances),
                        holders=len(slot.handles),
                        queries=slot.queries,
                        invalid_records=tuple(sorted(slot.invalid.items())),
                        evidence=None if isinstance(view, Refusal) else view.evidence.value,
                        weak=not isinstance(view, Refusal) and view.evidence.weak,
                    )
                )
            connections.append(
                ConnectionMetrics(
                    name=name,
                    prepared=connection.prepared,
                    queries=stats.queries,
                    failures=stats.failures,
                    latency_last=stats.latency_last,
                    latency_avg=stats.latency_total / stats.queries if stats.queries else 0.0,
                    latency_max=stats.latency_max,
                    latency_histogram=tuple(
                        zip(LATENCY_BUCKETS, stats.latency_buckets, strict=True)
                    ),
                    invalid_records=stats.invalid_records,
                    capacity_rejections=stats.capacity_rejections,
                    identity_revocations=stats.identity_revocations,
                    services=tuple(services),
                )
            )
        ledger = runtime.ledger
        capacity = CapacityUse(
            instances=ledger.instances,
            max_total_instances=ledger.max_total_instances,
            snapshot_bytes=ledger.size,
            max_snapshot_bytes=ledger.max_snapshot_bytes,
            snapshots_held=ledger.held,
            watch_streams=runtime.streams.in_use,
            max_watch_streams=runtime.streams.limit,
            watch_streams_queued=runtime.streams.queued,
            transport_tasks=runtime.tasks.in_use,
            max_transport_tasks=runtime.tasks.limit,
            watch_streams_oversized=runtime.streams.oversized,
        )
        registrations: tuple[object, ...] = ()
        states: list[RegistrationMetrics] = []
        if owner._registrations is not None:
            try:
                registrations = tuple(owner._registrations.report())
            except Exception:
                logger.exception("the registration report failed")
            try:
                statuses = owner.registrations()
            except Exception:
                logger.exception("the registration statuses failed")
            else:
                states.extend(
                    RegistrationMetrics(
                        name=status.name,
                        qualifier=status.qualifier,
                        state=status.state,
                        write=status.write,
                        health=status.health,
                        eligible=status.eligible,
                        epoch=status.epoch,
                        residual_risk=status.residual_risk,
                        startup_required=status.startup_required,
                        readiness_critical=status.readiness_critical,
                    )
                    for status in statuses.values()
                )
        return ObserverSnapshot(
            taken_at=now,
            phase=owner.phase,
            prepared=owner.prepared,
            connections=tuple(connections),
            capacity=capacity,
            live_tasks=runtime.live_tasks,
            registrations=registrations,
            registration_states=tuple(states),
        )

    return read
