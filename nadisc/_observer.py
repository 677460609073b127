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

Two more reads serve the console and ``nadisc watch`` (not metrics labels):
:meth:`RuntimeObserver.listings` gives each observed service's served
instances (identity, address, weight: never metadata or credentials) with
revision, evidence kind and age against ``max_age``; the snapshot's
``routes`` give each calling route's balancer view (per endpoint in-flight,
requests sent, PeakEWMA estimate, readiness, draining). Registrations carry
renewal counts and their recent state changes (:mod:`nadisc._journal`).
A route also counts its failures by closed kind (``RouteMetrics.failures``,
see :class:`~nadisc.CallFailureKind`) and per endpoint (``EndpointMetrics.failed``),
and shows its outlier ejections (``RouteMetrics.ejections``, ``ejected_endpoints``;
``EndpointMetrics.ejected``, ``ejected_for``).
A connection that failed to prepare says why (``ConnectionMetrics.prepare_error``,
redacted, and ``prepare_error_kind``).
The snapshot's ``grpc_calls`` give, per connection that a gRPC discovery
channel was opened on, the calls by final status code and their latency
histogram (:class:`GrpcCallMetrics`); the owner keeps these counts, so a
closed channel's calls stay counted.

Costs: ``snapshot()`` is O(connections + services + registrations + route
endpoints); ``listings()`` is O(services) while nothing changed (the
instance views are cached per listing generation), plus O(instances) for a
service whose listing changed.

A :class:`RuntimeObserver` holds no close rights: it only reads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from ._balancing import BalancingStatistics
from ._capacity import CapacityUse
from ._connection import LATENCY_BUCKETS
from ._evidence import Refusal
from ._grpc_calls import GRPC_STATUS_NAMES
from ._journal import RegistrationJournal
from ._registration_state import HealthEvidence, RegistrationState, WriteOutcome
from ._route import CALL_LATENCY_BUCKETS

if TYPE_CHECKING:
    from ._observation import Slot
    from ._owner import DiscoveryOwner, Phase
    from ._route import Route
    from ._transport import DiscoveryTransport

__all__ = [
    "ConnectionMetrics",
    "EndpointMetrics",
    "GrpcCallMetrics",
    "InstanceView",
    "ObserverSnapshot",
    "RegistrationMetrics",
    "RouteMetrics",
    "RuntimeObserver",
    "ServiceListing",
    "ServiceMetrics",
    "route_metrics",
    "transport_routes",
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
    #: Failed refreshes by closed failure kind (``FailureKind`` values), sorted.
    failure_kinds: tuple[tuple[str, int], ...] = ()
    #: Why prepare failed, as a short reason with the connection's secrets
    #: and credential-looking values redacted (None: prepared or pending).
    #: Diagnostic only: never a metrics label.
    prepare_error: str | None = None
    #: The closed kind of that failure: a ``ProviderFailure`` class name,
    #: ``ProviderRaised`` or ``DeadlineExceeded`` (None: no failure).
    prepare_error_kind: str | None = None


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
    #: Acknowledged renewals so far.
    renewals: int = 0
    #: Renewals refused, lost or finding the lease gone.
    renewal_failures: int = 0
    #: The last state changes as (event-loop time, state), oldest first.
    history: tuple[tuple[float, RegistrationState], ...] = ()
    #: Kind (class name) of the last failure; never a message.
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class EndpointMetrics:
    """One endpoint of a calling route's balance."""

    #: The instance identity (diagnostic: never a metrics label).
    identity: str
    #: Calls of this generation not finished yet (bodies included).
    in_flight: int
    #: Requests handed to the HTTP pool for this identity (all generations).
    sent: int
    #: PeakEWMA round-trip estimate in seconds (None: the policy keeps none).
    rtt_estimate: float | None
    #: ``idle``, ``ready`` or ``failed`` (quarantined).
    readiness: str
    eligible: bool
    #: Removed from the listing; finishing its calls in flight.
    draining: bool
    #: Failed attempts of this identity (all generations; any kind but ``no_endpoint``).
    failed: int = 0
    #: Kept out by outlier ejection now (``rest.outlier``).
    ejected: bool = False
    #: Seconds until its ejection ends (None: not ejected).
    ejected_for: float | None = None


@dataclass(frozen=True, slots=True)
class RouteMetrics:
    """The balancer of one (connection, service) calling route."""

    connection: str
    service: str
    #: Observation revision mirrored into the balance (-1: none yet).
    revision: int
    #: Requests sent through this route (sum over endpoints).
    calls: int
    in_flight: int
    #: Endpoints quarantined after a readiness failure.
    failed_endpoints: int
    endpoints: tuple[EndpointMetrics, ...]
    #: (failure kind, count) for every :class:`~nadisc.CallFailureKind` value, in declaration order.
    failures: tuple[tuple[str, int], ...] = ()
    #: Zones, subset, hedges and retry budget of the route (None: not reported).
    balancing: BalancingStatistics | None = None
    #: Endpoints kept out by outlier ejection now.
    ejected_endpoints: int = 0
    #: Ejections since the route opened.
    ejections: int = 0
    #: Whole-call latency per outcome: (outcome, counts per ``CALL_LATENCY_BUCKETS``
    #: bound plus one over the last, sum of seconds), in ``CALL_OUTCOMES`` order.
    latency: tuple[tuple[str, tuple[int, ...], float], ...] = ()
    #: What the route calls with: ``"http"`` (the discovery transport, the REST
    #: caller) or ``"grpc"`` (a gRPC discovery channel).
    protocol: str = "http"


@dataclass(frozen=True, slots=True)
class GrpcCallMetrics:
    """The gRPC discovery-channel calls of one connection (all its channels, open or closed)."""

    connection: str
    #: (status code name, calls that ended with it) for every gRPC status code, in code order.
    codes: tuple[tuple[str, int], ...]
    #: Calls per ``CALL_LATENCY_BUCKETS`` bound, plus one over the last (whole calls).
    latency: tuple[int, ...]
    latency_sum: float

    @property
    def calls(self) -> int:
        """Calls finished, whatever their status."""
        return sum(count for _code, count in self.codes)

    def quantile(self, q: float) -> float | None:
        """The bucket bound below which a share ``q`` of the calls finished (None: no calls;
        ``inf``: beyond the last bound)."""
        total = sum(self.latency)
        if not total:
            return None
        wanted = q * total
        seen = 0
        for bound, count in zip((*CALL_LATENCY_BUCKETS, math.inf), self.latency, strict=True):
            seen += count
            if seen >= wanted:
                return bound
        return math.inf


@dataclass(frozen=True, slots=True)
class InstanceView:
    """What the console shows of a served instance: never metadata or tags."""

    identity: str
    address: str
    weight: float


@dataclass(frozen=True, slots=True)
class ServiceListing:
    """One observed service's served listing, for the console and ``watch``."""

    connection: str
    service: str
    #: The observation's generation (grows whenever what it serves changes).
    revision: int
    #: The listing's evidence kind (None: no listing yet).
    evidence: str | None
    #: Event-loop time of the last complete listing (None: none yet).
    confirmed_at: float | None
    #: The connection's ``snapshot.max_age`` in seconds.
    max_age: float
    #: Served from the grace window after a failed refresh.
    degraded: bool
    #: None when usable now; otherwise the refusal reason.
    unavailable_reason: str | None
    #: The kind of the failed refresh in force (None: the last refresh worked).
    last_failure: str | None
    instances: tuple[InstanceView, ...]
    #: Why the last refresh failed, ``"<kind>: <message>"``, at most 200
    #: characters with the connection's secrets redacted (None once a
    #: complete listing arrived). Never a metric label.
    failure_reason: str | None = None


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
    #: The balancer view of every route of the owner's REST callers.
    routes: tuple[RouteMetrics, ...] = ()
    #: gRPC discovery-channel calls per connection (sorted by connection).
    grpc_calls: tuple[GrpcCallMetrics, ...] = ()

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

    __slots__ = ("_list", "_read")

    def __init__(self, owner: DiscoveryOwner) -> None:
        # Keep only reading functions, not the owner itself.
        self._read: Callable[[float], ObserverSnapshot] = _reader(owner)
        self._list: Callable[[float], tuple[ServiceListing, ...]] = _lister(owner)

    def snapshot(self) -> ObserverSnapshot:
        """An immutable record of the owner's state now."""
        return self._read(anyio.current_time())

    def listings(self, now: float | None = None) -> tuple[ServiceListing, ...]:
        """Every observed service's served listing at ``now`` (default: the clock),
        sorted by (connection, service). Repeated calls reuse the instance
        views of listings whose generation did not move."""
        return self._list(anyio.current_time() if now is None else now)

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
                    failure_kinds=tuple(sorted(stats.failure_kinds.items())),
                    prepare_error=connection.prepare_error,
                    prepare_error_kind=connection.prepare_error_kind,
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
        journal = _journal_of(owner)
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
                for status in statuses.values():
                    entry = journal.entry(status.name) if journal is not None else None
                    history = tuple(entry.history) if entry is not None else ()
                    if not history or history[-1][1] is not status.state:
                        # A change by the passage of time alone (evidence ran out).
                        history = (*history, (now, status.state))
                    states.append(
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
                            renewals=entry.renewals if entry is not None else 0,
                            renewal_failures=entry.renewal_failures if entry is not None else 0,
                            history=history,
                            last_error=getattr(status, "last_error", None),
                        )
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
            routes=(
                *(
                    route_metrics(route)
                    for client in tuple(owner._rest.values())
                    if client.transport is not None
                    for route in transport_routes(client.transport)
                ),
                *(route_metrics(route, "grpc") for route in tuple(owner._grpc_routes)),
            ),
            grpc_calls=tuple(
                GrpcCallMetrics(
                    connection=name,
                    codes=tuple(zip(GRPC_STATUS_NAMES, counts.codes, strict=True)),
                    latency=tuple(counts.latency),
                    latency_sum=counts.latency_sum,
                )
                for name, counts in sorted(owner._grpc_calls.items())
            ),
        )

    return read


def _journal_of(owner: DiscoveryOwner) -> RegistrationJournal | None:
    component = owner._registrations
    inner = getattr(component, "registrations", None)
    journal = getattr(inner, "journal", None)
    return journal if isinstance(journal, RegistrationJournal) else None


def transport_routes(transport: DiscoveryTransport) -> tuple[Route, ...]:
    """The live routes of a discovery transport (none once it is closed)."""
    return () if transport.closed else transport.routes()


def route_metrics(route: Route, protocol: str = "http") -> RouteMetrics:
    """The balancer view of one route now. O(endpoints); reads only."""
    from poise import GenerationTracker, PeakEwma, ReadinessState

    stats = route.statistics()
    ejected = stats.ejected
    now = route.clock() if ejected else 0.0
    endpoints: list[EndpointMetrics] = []
    failed = 0
    for endpoint in route.streaming.balance.endpoints:
        tracker = endpoint.tracker
        draining = False
        open_calls = 0
        if isinstance(tracker, GenerationTracker):
            draining = tracker.retired
            open_calls = tracker.open_guards
            tracker = tracker.inner
        rtt = tracker.rtt_estimate if isinstance(tracker, PeakEwma) else None
        readiness = endpoint.state
        if readiness is ReadinessState.FAILED:
            failed += 1
        identity = str(endpoint.key)
        endpoints.append(
            EndpointMetrics(
                identity=identity,
                in_flight=open_calls,
                sent=stats.sent.get(identity, 0),
                rtt_estimate=rtt,
                readiness=readiness.value,
                eligible=endpoint.eligible,
                draining=draining,
                failed=stats.failed.get(identity, 0),
                ejected=identity in ejected,
                ejected_for=max(0.0, ejected[identity] - now) if identity in ejected else None,
            )
        )
    return RouteMetrics(
        connection=stats.connection,
        service=stats.service,
        revision=stats.revision,
        calls=sum(stats.sent.values()),
        in_flight=sum(stats.in_flight.values()),
        failed_endpoints=failed,
        endpoints=tuple(endpoints),
        failures=tuple(stats.failures.items()),
        balancing=route.balancing.statistics(),
        ejected_endpoints=len(ejected),
        ejections=stats.ejections,
        latency=tuple((k, counts, total) for k, (counts, total) in stats.latency.items()),
        protocol=protocol,
    )


def _lister(owner: DiscoveryOwner) -> Callable[[float], tuple[ServiceListing, ...]]:
    # (connection, alias) -> (slot, generation, instance views)
    cache: dict[tuple[str, str], tuple[Slot, int, tuple[InstanceView, ...]]] = {}

    def listings(now: float) -> tuple[ServiceListing, ...]:
        out: list[ServiceListing] = []
        seen: set[tuple[str, str]] = set()
        for name, connection in sorted(owner._connections.items()):
            for alias, slot in sorted(connection.slots.items()):
                key = (name, alias)
                seen.add(key)
                evidence = slot.evidence
                view = evidence.view(now)
                cached = cache.get(key)
                if cached is not None and cached[0] is slot and cached[1] == evidence.generation:
                    instances = cached[2]
                else:
                    instances = (
                        ()
                        if isinstance(view, Refusal)
                        else tuple(
                            InstanceView(i.identity, i.address, i.weight) for i in view.instances
                        )
                    )
                    cache[key] = (slot, evidence.generation, instances)
                kind = None if isinstance(view, Refusal) else view.evidence.value
                failure = evidence.failure
                out.append(
                    ServiceListing(
                        connection=name,
                        service=alias,
                        revision=evidence.generation,
                        evidence=kind,
                        confirmed_at=evidence.confirmed_at,
                        max_age=evidence.policy.max_age,
                        degraded=False if isinstance(view, Refusal) else view.degraded,
                        unavailable_reason=(
                            view.reason.value if isinstance(view, Refusal) else None
                        ),
                        last_failure=None if failure is None else failure.value,
                        instances=() if isinstance(view, Refusal) else instances,
                        failure_reason=slot.failure_reason,
                    )
                )
        for key in [k for k in cache if k not in seen]:
            del cache[key]
        return tuple(out)

    return listings
