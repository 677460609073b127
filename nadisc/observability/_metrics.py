"""Prometheus metrics of one discovery owner, read from its observer at scrape time.

Contract: :class:`DiscoveryCollector` is a ``prometheus_client`` custom
collector. Each ``collect()`` takes one ``owner.observer().snapshot()`` and
turns it into ``nadisc_discovery_*`` families; nothing runs between scrapes
(no task, no timer, no cached state). Labels come only from a closed set:
the configured connection name (``connection``), the configured
registration name (``registration``) and closed enumerations (``phase``,
``state``, ``kind``, ``reason``, ``outcome``, ``readiness``). Service names
(aliases or remote), instance identities, addresses, metadata and
credentials never appear; per-service facts are aggregated per connection.

::

    Prometheus ──GET──▶ metrics_app (ASGI) ──▶ generate_latest(registry)
                                                  └─▶ DiscoveryCollector.collect()
                                                        └─▶ observer.snapshot()  (reads only)

A scrape must run on the owner's event loop (the ASGI app does): the
observer reads the loop's clock. Costs per scrape: O(connections + observed
services + registrations + route endpoints), one exposition string.

Counters built from live routes (``nadisc_discovery_balancer_calls_total``,
``nadisc_discovery_balancer_failures_total``) restart when a route is
closed and re-created; Prometheus' ``rate()`` treats that as a counter
reset. ``balancer_failures_total{kind}`` uses the closed set
:class:`nadisc.CallFailureKind`: ``transport``, ``timeout``, ``status`` and
``other`` count attempts that were sent (so they are part of
``balancer_calls_total``), ``no_endpoint`` counts calls that reached no
instance (not part of it).

gRPC discovery channels: ``nadisc_discovery_grpc_calls_total{connection,code}``
(every gRPC status code name, zeros included: a closed set) and
``nadisc_discovery_grpc_call_duration_seconds{connection}`` (whole calls:
picks, probes and transparent retries included; the buckets of the routed
calls). The owner keeps these counts per connection, so they never restart
when a channel closes; a connection appears once a channel was opened on it.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .._evidence import FailureKind, Reason
from .._observer import (
    ObserverSnapshot,
    RouteMetrics,
    RuntimeObserver,
    ServiceListing,
    route_metrics,
)
from .._registration import CloseOutcome
from .._registration_state import RegistrationState
from .._route import CALL_FAILURE_KINDS, CALL_LATENCY_BUCKETS, CALL_OUTCOMES
from ._asgi import Receive, Scope, Send, bearer_ok, lifespan, local_path, send_text

if TYPE_CHECKING:
    from .._owner import DiscoveryOwner
    from .._transport import DiscoveryTransport

__all__ = ["DiscoveryCollector", "MetricsApp", "metrics_app", "register_metrics"]

PREFIX = "nadisc_discovery"
_PHASES = (
    "built",
    "preparing",
    "prepared",
    "frozen",
    "published",
    "quiescing",
    "closing",
    "closed",
)
_READINESS = ("idle", "ready", "failed")


def _name(suffix: str) -> str:
    return f"{PREFIX}_{suffix}"


class DiscoveryCollector(Collector):
    """Reads ``observer`` on every ``collect()``; register it in a ``CollectorRegistry``.

    ``transports`` adds the routes of :class:`~nadisc.DiscoveryTransport`
    objects built directly (the routes of ``owner.rest()`` callers are in
    the observer already).
    """

    def __init__(
        self,
        observer: RuntimeObserver,
        *,
        transports: Sequence[DiscoveryTransport] = (),
        providers: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(observer, RuntimeObserver):
            raise TypeError(
                f"DiscoveryCollector needs a RuntimeObserver, not {type(observer).__name__}"
            )
        self._observer = observer
        self._transports = tuple(transports)
        #: connection name -> configured provider name (for ``connection_info``).
        self._providers = dict(providers or {})

    def describe(self) -> Iterable[Metric]:
        # Names only: registering must not read the owner (it may run off the loop).
        balancer, latency = _route_families(None)
        return [
            *_build_info(),
            *_families(None, balancer),
            *_extra_families(None, {}, (), latency),
            *_grpc_families(None),
        ]

    def collect(self) -> Iterable[Metric]:
        try:
            snapshot = self._observer.snapshot()
        except RuntimeError as exc:
            raise RuntimeError(
                "the discovery metrics are read on the owner's event loop "
                "(serve them through metrics_app, not a metrics thread)"
            ) from exc
        extra: list[RouteMetrics] = []
        for transport in self._transports:
            if not transport.closed:
                extra.extend(route_metrics(route) for route in transport.routes())
        listings = self._observer.listings()
        balancer, latency = _route_families(_routes_per_connection(snapshot, extra))
        return [
            *_build_info(),
            *_families(snapshot, balancer),
            *_extra_families(snapshot, self._providers, listings, latency),
            *_grpc_families(snapshot),
        ]

    def __repr__(self) -> str:
        return f"<DiscoveryCollector transports={len(self._transports)}>"


def _families(snap: ObserverSnapshot | None, balancer: Sequence[Metric]) -> Iterator[Metric]:
    """The owner, connection and registration families, then ``balancer``
    (built by :func:`_route_families`)."""
    g = GaugeMetricFamily
    c = CounterMetricFamily

    phase = g(_name("phase"), "Owner lifecycle phase (one-hot).", labels=["phase"])
    prepared = g(_name("prepared"), "1 once initial preparation passed.")
    tasks = g(_name("live_tasks"), "Tasks of the owner alive now.")
    if snap is not None:
        for value in _PHASES:
            phase.add_metric([value], 1.0 if snap.phase.value == value else 0.0)
        prepared.add_metric([], 1.0 if snap.prepared else 0.0)
        tasks.add_metric([], float(snap.live_tasks))
    yield from (phase, prepared, tasks)

    conn = ["connection"]
    c_prepared = g(
        _name("connection_prepared"),
        "1 prepared, 0 prepare failed, -1 not prepared yet.",
        labels=conn,
    )
    queries = c(_name("queries"), "Provider queries finished.", labels=conn)
    errors = c(_name("query_errors"), "Failed refreshes by closed kind.", labels=[*conn, "kind"])
    duration = HistogramMetricFamily(
        _name("query_duration_seconds"), "Provider query duration.", labels=conn
    )
    invalid = c(_name("invalid_records"), "Confirmed invalid records seen.", labels=conn)
    rejected = c(
        _name("capacity_rejections"), "Listings withheld by a capacity limit.", labels=conn
    )
    revoked = c(_name("identity_revocations"), "Identity revocations seen.", labels=conn)
    age = g(
        _name("evidence_age_seconds"),
        "Age of the oldest complete listing among the connection's observed services.",
        labels=conn,
    )
    observed = g(_name("observations"), "Observed services (slots).", labels=conn)
    holders = g(_name("observation_handles"), "Live Observation handles.", labels=conn)
    unavailable = g(
        _name("observations_unavailable"),
        "Observed services refusing to serve, by reason.",
        labels=[*conn, "reason"],
    )
    served = g(_name("instances_served"), "Instances served now (usable listings).", labels=conn)
    weak = g(
        _name("observations_weak"),
        "Observed services served on weaker evidence (strict reads refuse them).",
        labels=conn,
    )
    if snap is not None:
        for m in snap.connections:
            label = [m.name]
            c_prepared.add_metric(label, -1.0 if m.prepared is None else float(m.prepared))
            queries.add_metric(label, float(m.queries))
            kinds = dict(m.failure_kinds)
            for kind in FailureKind:
                errors.add_metric([m.name, kind.value], float(kinds.get(kind.value, 0)))
            bounds = tuple(bound for bound, _count in m.latency_histogram)
            counts = [count for _bound, count in m.latency_histogram]
            duration.add_metric(label, _buckets(bounds, counts), m.latency_avg * m.queries)
            invalid.add_metric(label, float(m.invalid_records))
            rejected.add_metric(label, float(m.capacity_rejections))
            revoked.add_metric(label, float(m.identity_revocations))
            ages = [s.evidence_age for s in m.services if s.evidence_age is not None]
            if ages:
                age.add_metric(label, max(ages))
            observed.add_metric(label, float(len(m.services)))
            holders.add_metric(label, float(sum(s.holders for s in m.services)))
            reasons: dict[str, int] = {}
            for s in m.services:
                if s.unavailable_reason is not None:
                    reasons[s.unavailable_reason] = reasons.get(s.unavailable_reason, 0) + 1
            for reason in Reason:
                unavailable.add_metric([m.name, reason.value], float(reasons.get(reason.value, 0)))
            served.add_metric(label, float(sum(s.instances for s in m.services)))
            weak.add_metric(label, float(sum(1 for s in m.services if s.weak)))
    yield from (c_prepared, queries, errors, duration, invalid, rejected, revoked, age)
    yield from (observed, holders, unavailable, served, weak)

    capacity = [
        ("capacity_instances", "Instances held in admitted listings.", "instances"),
        ("capacity_instances_limit", "limits.max_total_instances.", "max_total_instances"),
        ("capacity_snapshot_bytes", "Bytes of admitted listings.", "snapshot_bytes"),
        ("capacity_snapshot_bytes_limit", "limits.max_snapshot_bytes.", "max_snapshot_bytes"),
        (
            "capacity_snapshots_held",
            "Listings held (current and still referenced).",
            "snapshots_held",
        ),
        ("watch_streams", "Watch streams open.", "watch_streams"),
        ("watch_streams_limit", "limits.max_watch_streams.", "max_watch_streams"),
        ("watch_streams_queued", "Watches waiting for a stream.", "watch_streams_queued"),
        ("transport_tasks", "Transport tasks in use.", "transport_tasks"),
        ("transport_tasks_limit", "limits.max_transport_tasks.", "max_transport_tasks"),
    ]
    for suffix, text, attr in capacity:
        family = g(_name(suffix), text)
        if snap is not None:
            family.add_metric([], float(getattr(snap.capacity, attr)))
        yield family

    reg = ["registration", "connection"]
    state = g(_name("registration_state"), "Registration state (one-hot).", labels=[*reg, "state"])
    residual = g(
        _name("registration_residual_risk"), "An earlier write may still land.", labels=reg
    )
    eligible = g(_name("registration_eligible"), "Locally eligible now.", labels=reg)
    renewals = c(_name("registration_renewals"), "Acknowledged renewals.", labels=reg)
    renew_failed = c(
        _name("registration_renewal_failures"),
        "Renewals refused, lost or finding the lease gone.",
        labels=reg,
    )
    if snap is not None:
        for r in snap.registration_states:
            label = [r.name, r.qualifier]
            for known in RegistrationState:
                state.add_metric([*label, known.value], 1.0 if r.state is known else 0.0)
            residual.add_metric(label, float(r.residual_risk))
            eligible.add_metric(label, float(r.eligible))
            renewals.add_metric(label, float(r.renewals))
            renew_failed.add_metric(label, float(r.renewal_failures))
    yield from (state, residual, eligible, renewals, renew_failed)

    outcome = g(
        _name("close_outcome"),
        "What shutdown left behind per registration (one-hot; 'registered' before close).",
        labels=[*reg, "outcome"],
    )
    if snap is not None:
        for entry in snap.registrations:
            name = getattr(entry, "name", None)
            qualifier = getattr(entry, "qualifier", None)
            result = getattr(entry, "outcome", None)
            if not isinstance(name, str) or not isinstance(qualifier, str):
                continue
            for item in CloseOutcome:
                outcome.add_metric([name, qualifier, item.value], 1.0 if result is item else 0.0)
    yield outcome

    yield from balancer


def _version() -> str:
    try:
        return importlib.metadata.version("poise-nadisc")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "unknown"


_VERSION = _version()


def _build_info() -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "nadisc_build_info",
        "The nadisc build serving these metrics (always 1).",
        labels=["version"],
    )
    info.add_metric([_VERSION], 1.0)
    yield info


def _extra_families(
    snap: ObserverSnapshot | None,
    providers: Mapping[str, str],
    listings: Sequence[ServiceListing],
    latency: Metric,
) -> Iterator[Metric]:
    """Connection info and state, evidence age against max_age, then ``latency``
    (the routed-call histogram, built by :func:`_route_families`)."""
    conn = ["connection"]
    info = GaugeMetricFamily(
        _name("connection_info"),
        "A configured connection and its provider (always 1).",
        labels=[*conn, "provider"],
    )
    state = GaugeMetricFamily(
        _name("connection_state"),
        "Connection preparation state (one-hot): pending, prepared or failed.",
        labels=[*conn, "state"],
    )
    ratio = GaugeMetricFamily(
        _name("evidence_age_ratio"),
        "Largest evidence age / snapshot.max_age among the connection's observed services "
        "(1 = the oldest listing reached max_age; a never-confirmed service counts as 1).",
        labels=conn,
    )
    if snap is not None:
        for m in snap.connections:
            info.add_metric([m.name, providers.get(m.name, "unknown")], 1.0)
            current = "pending" if m.prepared is None else "prepared" if m.prepared else "failed"
            for known in _CONNECTION_STATES:
                state.add_metric([m.name, known], 1.0 if known == current else 0.0)
        worst: dict[str, float] = {}
        at = anyio.current_time()
        for listing in listings:
            if listing.confirmed_at is None or listing.max_age <= 0:
                value = 1.0
            else:
                value = max(0.0, at - listing.confirmed_at) / listing.max_age
            worst[listing.connection] = max(worst.get(listing.connection, 0.0), value)
        for name, value in sorted(worst.items()):
            ratio.add_metric([name], value)
    yield from (info, state, ratio, latency)


_CONNECTION_STATES = ("pending", "prepared", "failed")


def _routes_per_connection(
    snap: ObserverSnapshot, extra: Sequence[RouteMetrics]
) -> dict[str, list[RouteMetrics]]:
    """The routes of every connection (the owner's and ``extra``), each
    configured connection listed even without a route."""
    per: dict[str, list[RouteMetrics]] = {m.name: [] for m in snap.connections}
    for route in (*snap.routes, *extra):
        per.setdefault(route.connection, []).append(route)
    return per


def _route_families(
    per: Mapping[str, Sequence[RouteMetrics]] | None,
) -> tuple[tuple[Metric, ...], Metric]:
    """Every per-connection route family, filled in one pass over each
    connection's routes: the balancer families (in exposition order) and the
    routed-call latency histogram. ``per=None``: the empty families."""
    g = GaugeMetricFamily
    c = CounterMetricFamily
    conn = ["connection"]
    routes = g(_name("balancer_routes"), "Calling routes (one per service called).", labels=conn)
    calls = c(_name("balancer_calls"), "Requests sent through the routes.", labels=conn)
    failures = c(
        _name("balancer_failures"),
        "Failed attempts (transport, timeout, status, other) and calls that reached "
        "no instance (no_endpoint), by closed kind.",
        labels=[*conn, "kind"],
    )
    in_flight = g(_name("balancer_in_flight"), "Calls in flight.", labels=conn)
    endpoints = g(
        _name("balancer_endpoints"), "Balance endpoints by readiness.", labels=[*conn, "readiness"]
    )
    draining = g(_name("balancer_endpoints_draining"), "Endpoints finishing calls.", labels=conn)
    ejected = g(
        _name("balancer_endpoints_ejected"), "Endpoints kept out by outlier ejection.", labels=conn
    )
    refused = c(
        _name("balancer_retry_budget_refused"),
        "Retries and hedges the routes' retry budgets refused.",
        labels=conn,
    )
    hedges = c(_name("balancer_hedges"), "Hedged attempts sent.", labels=conn)
    hedge_wins = c(_name("balancer_hedge_wins"), "Hedges that answered first.", labels=conn)
    mirrored = g(
        _name("balancer_subset_instances"),
        "Instances the routes use after subsetting and zone preference.",
        labels=conn,
    )
    latency = HistogramMetricFamily(
        _name("call_duration_seconds"),
        "Routed calls (all attempts, to the response headers or the error) by outcome: "
        "ok, or the call failure kind that ended it.",
        labels=[*conn, "outcome"],
    )
    balancer: tuple[Metric, ...] = (routes, calls, failures, in_flight, endpoints, draining)
    balancer += (ejected, refused, hedges, hedge_wins, mirrored)
    for name, items in sorted((per or {}).items()):
        n_calls = n_in_flight = n_drained = n_ejected = 0
        n_refused = n_hedges = n_wins = n_mirrored = 0
        failed = dict.fromkeys(CALL_FAILURE_KINDS, 0)
        readiness = dict.fromkeys(_READINESS, 0)
        counts = {outcome: [0] * (len(CALL_LATENCY_BUCKETS) + 1) for outcome in CALL_OUTCOMES}
        totals = dict.fromkeys(CALL_OUTCOMES, 0.0)
        for route in items:
            n_calls += route.calls
            n_in_flight += route.in_flight
            n_ejected += route.ejected_endpoints
            for failure, count in route.failures:
                failed[failure] += count
            for e in route.endpoints:
                readiness[e.readiness] = readiness.get(e.readiness, 0) + 1
                n_drained += e.draining
            if (view := route.balancing) is not None:
                n_refused += view.budget_refused
                n_hedges += view.hedges
                n_wins += view.hedge_wins
                n_mirrored += view.mirrored
            for outcome, values, seconds in route.latency:
                if outcome in counts:
                    counts[outcome] = [a + b for a, b in zip(counts[outcome], values, strict=True)]
                    totals[outcome] += seconds
        routes.add_metric([name], float(len(items)))
        calls.add_metric([name], float(n_calls))
        for failure in CALL_FAILURE_KINDS:
            failures.add_metric([name, failure], float(failed[failure]))
        in_flight.add_metric([name], float(n_in_flight))
        for state in _READINESS:
            endpoints.add_metric([name, state], float(readiness[state]))
        draining.add_metric([name], float(n_drained))
        ejected.add_metric([name], float(n_ejected))
        refused.add_metric([name], float(n_refused))
        hedges.add_metric([name], float(n_hedges))
        hedge_wins.add_metric([name], float(n_wins))
        mirrored.add_metric([name], float(n_mirrored))
        for outcome in CALL_OUTCOMES:
            latency.add_metric(
                [name, outcome], _buckets(_CALL_BOUNDS, counts[outcome]), totals[outcome]
            )
    return balancer, latency


_CALL_BOUNDS = (*CALL_LATENCY_BUCKETS, math.inf)


def _buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Prometheus' cumulative ``(le, count)`` buckets from per-bucket counts."""
    cumulative = 0
    buckets: list[tuple[str, float]] = []
    for bound, count in zip(bounds, counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == math.inf else repr(bound), float(cumulative)))
    return buckets


def _grpc_families(snap: ObserverSnapshot | None) -> Iterator[Metric]:
    """The gRPC discovery-channel calls per connection (kept by the owner)."""
    calls = CounterMetricFamily(
        _name("grpc_calls"),
        "gRPC calls through discovery channels, by final status code.",
        labels=["connection", "code"],
    )
    duration = HistogramMetricFamily(
        _name("grpc_call_duration_seconds"),
        "gRPC calls through discovery channels, whole calls (picks, probes, retries).",
        labels=["connection"],
    )
    for row in () if snap is None else snap.grpc_calls:
        for code, count in row.codes:
            calls.add_metric([row.connection, code], float(count))
        duration.add_metric([row.connection], _buckets(_CALL_BOUNDS, row.latency), row.latency_sum)
    yield from (calls, duration)


def register_metrics(
    owner: DiscoveryOwner,
    registry: CollectorRegistry,
    *,
    transports: Sequence[DiscoveryTransport] = (),
) -> DiscoveryCollector:
    """Register a :class:`DiscoveryCollector` of ``owner`` in an existing registry.

    Returns the collector (``registry.unregister(collector)`` removes it).
    Raises ``ValueError`` (from ``prometheus_client``) when the registry
    already holds ``nadisc_discovery_*`` families, e.g. a second owner.
    """
    providers = {name: c.policy.provider for name, c in owner._connections.items()}
    collector = DiscoveryCollector(owner.observer(), transports=transports, providers=providers)
    registry.register(collector)
    return collector


class MetricsApp:
    """An ASGI app answering ``GET`` (any path under its mount) with the exposition.

    Works under a mount prefix (it never looks at the path beyond its mount).
    With ``token`` set, requests need ``Authorization: Bearer <token>``.
    """

    def __init__(self, registry: CollectorRegistry, *, token: str | None = None) -> None:
        self._registry = registry
        self._token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "lifespan":
            await lifespan(receive, send)
            return
        if kind != "http":
            raise RuntimeError(f"the metrics app serves HTTP, not {kind!r}")
        await self.serve_http(scope, send)

    async def serve_http(self, scope: Scope, send: Send) -> None:
        local_path(scope)
        if scope.get("method") not in ("GET", "HEAD"):
            await send_text(send, 405, "method not allowed\n", extra=[(b"allow", b"GET, HEAD")])
            return
        if not bearer_ok(scope, self._token):
            await send_text(send, 401, "unauthorized\n", extra=[(b"www-authenticate", b"Bearer")])
            return
        body = generate_latest(self._registry)
        await send_text(
            send,
            200,
            body if scope.get("method") == "GET" else b"",
            content_type=CONTENT_TYPE_LATEST,
            length=len(body),
        )

    def __repr__(self) -> str:
        return f"<MetricsApp token={'set' if self._token else 'none'}>"


def metrics_app(
    owner: DiscoveryOwner,
    *,
    registry: CollectorRegistry | None = None,
    transports: Sequence[DiscoveryTransport] = (),
    token: str | None = None,
) -> MetricsApp:
    """An ASGI app exposing ``owner``'s metrics.

    Without ``registry`` a private registry holding only the discovery
    families is used; with one, the collector is registered into it and the
    app serves the whole registry.
    """
    target = registry if registry is not None else CollectorRegistry(auto_describe=False)
    register_metrics(owner, target, transports=transports)
    return MetricsApp(target, token=token)
