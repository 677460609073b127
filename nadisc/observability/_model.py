"""The console's state model: observer reads turned into versioned JSON parts.

Contract: :class:`ConsoleModel` turns the observer's ``snapshot()`` and
``listings()`` into JSON text, split into parts that change independently:
one part per observed service (``"<connection>/<service>"``: revision,
evidence kind, confirmed-at time, ``max_age``, failure, instances) and one
"overview" part (owner, connections, registrations with their history,
gRPC discovery calls per connection: counts by status code and the p99
bucket bound). Every part has a version that moves only when its text changes.

Latest-only delivery: a client remembers the versions it has seen;
:meth:`ConsoleSample.delta` gives the message that brings *that* client from
what it saw to the newest sample, whatever happened in between, so a slow
client skips intermediate states instead of queueing them. Memory per
client: one version per service, never a queue of messages.

Sampling: :meth:`ConsoleModel.run` reads the owner every ``interval``
seconds whether or not a client is connected (the console's lifespan runs
it in the server's task group); a sample whose parts all kept their
versions wakes nobody. Without it (an app served without lifespan), a
waiting client samples for everyone and ``/state`` samples on demand.
Routes are parts of their own, so a route's counters moving does not
resend the overview or any service.

Costs per sample: O(services + registrations + route endpoints) while
listings are unchanged; a changed service's instances are compared chunk
by chunk (``CHUNK`` rows) and only the chunks whose rows changed are
encoded, once, shared by every client. Per client per update: O(parts) to
compare versions, plus the bytes of what changed.

Adding a kind of part (e.g. per-channel rows): give :class:`ConsoleSample`
one more ``Parts`` mapping (key -> (version, JSON text), the version moving
only when the text changes), fill it in :meth:`ConsoleModel.resample`
(set ``changed`` when a version moves or a key goes), and have
:meth:`ConsoleSample.delta` emit it with :func:`_changed` under a prefix of
its own in ``seen`` and a message member of its own. Clients ignore
members they do not know, so the page and ``nadisc watch`` keep working.

What is shown: configured connection, service and registration names,
closed states, instance identities and addresses, weights, ages and
counters. Never metadata, tags, tokens or passwords (the observer does not
hand them out).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from .._observer import (
    ObserverSnapshot,
    RouteMetrics,
    RuntimeObserver,
    ServiceListing,
    route_metrics,
)

if TYPE_CHECKING:
    from .._transport import DiscoveryTransport

__all__ = ["ConsoleModel", "ConsoleSample"]

#: Default seconds between samples while a client waits.
DEFAULT_INTERVAL = 0.1


def _num(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, 6)


def _listing_head(listing: ServiceListing) -> dict[str, Any]:
    """A service's card without its instances or confirmed-at time."""
    return {
        "connection": listing.connection,
        "service": listing.service,
        "revision": listing.revision,
        "evidence": listing.evidence,
        "max_age": listing.max_age,
        "degraded": listing.degraded,
        "unavailable": listing.unavailable_reason,
        "last_failure": listing.last_failure,
        "failure_reason": listing.failure_reason,
    }


def _instance_row(identity: str, address: str, weight: float) -> dict[str, Any]:
    return {"identity": identity, "address": address, "weight": weight}


def service_part(listing: ServiceListing) -> dict[str, Any]:
    """A service as one JSON object (``nadisc watch --json`` and tests)."""
    return {
        **_listing_head(listing),
        "confirmed_at": _num(listing.confirmed_at),
        "instances": [_instance_row(i.identity, i.address, i.weight) for i in listing.instances],
    }


def _route_part(route: RouteMetrics) -> dict[str, Any]:
    return {
        "connection": route.connection,
        "service": route.service,
        "protocol": route.protocol,
        "revision": route.revision,
        "calls": route.calls,
        "in_flight": route.in_flight,
        "failed_endpoints": route.failed_endpoints,
        "failures": dict(route.failures),
        "endpoints": [
            {
                "identity": e.identity,
                "in_flight": e.in_flight,
                "sent": e.sent,
                "failed": e.failed,
                "rtt": _num(e.rtt_estimate),
                "readiness": e.readiness,
                "eligible": e.eligible,
                "draining": e.draining,
            }
            for e in route.endpoints
        ],
    }


def overview_part(snap: ObserverSnapshot) -> dict[str, Any]:
    capacity = snap.capacity
    return {
        "phase": snap.phase.value,
        "prepared": snap.prepared,
        "live_tasks": snap.live_tasks,
        "capacity": {
            "instances": [capacity.instances, capacity.max_total_instances],
            "snapshot_bytes": [capacity.snapshot_bytes, capacity.max_snapshot_bytes],
            "watch_streams": [capacity.watch_streams, capacity.max_watch_streams],
            "transport_tasks": [capacity.transport_tasks, capacity.max_transport_tasks],
        },
        "connections": [
            {
                "name": c.name,
                "prepared": c.prepared,
                "prepare_error": c.prepare_error,
                "prepare_error_kind": c.prepare_error_kind,
                "queries": c.queries,
                "failures": dict(c.failure_kinds),
                "latency_avg": _num(c.latency_avg),
                "latency_max": _num(c.latency_max),
                "services": len(c.services),
                "instances": sum(s.instances for s in c.services),
                "unavailable": sum(1 for s in c.services if s.unavailable_reason is not None),
            }
            for c in snap.connections
        ],
        "grpc": [
            {
                "connection": g.connection,
                "calls": g.calls,
                # In code order (a JSON object's keys would be sorted).
                "codes": [[code, count] for code, count in g.codes if count],
                "p99": _num(g.quantile(0.99)),
            }
            for g in snap.grpc_calls
        ],
        "registrations": [
            {
                "name": r.name,
                "connection": r.qualifier,
                "state": r.state.value,
                "write": r.write.value,
                "health": r.health.value,
                "eligible": r.eligible,
                "residual_risk": r.residual_risk,
                "renewals": r.renewals,
                "renewal_failures": r.renewal_failures,
                "last_error": r.last_error,
                "history": [[_num(t), s.value] for t, s in r.history],
            }
            for r in snap.registration_states
        ],
    }


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)


#: Instances per chunk of a service's listing (a part of its own).
CHUNK = 10

#: Seconds between two messages to a client when nothing changed (a "tick"
#: that carries only how old the data is).
HEARTBEAT = 1.0

Parts = Mapping[str, tuple[int, str]]


def _changed(
    parts: Parts, prefix: str, seen: dict[str, int], full: bool
) -> tuple[list[str], list[str], list[str]]:
    """(JSON members of the changed parts, their version members, removed keys)
    for one kind of part; ``seen`` keys are ``prefix + key``."""
    out: list[str] = []
    versions: list[str] = []
    for key, (version, text) in parts.items():
        mark = prefix + key
        if full or seen.get(mark) != version:
            name = _dumps(key)
            out.append(f"{name}:{text}")
            versions.append(f"{name}:{version}")
            seen[mark] = version
    removed = [k for k in seen if k.startswith(prefix) and k[len(prefix) :] not in parts]
    for mark in removed:
        del seen[mark]
    return out, versions, [k[len(prefix) :] for k in removed]


@dataclass(frozen=True, slots=True)
class ConsoleSample:
    """One sample: versioned JSON parts. Immutable; shared by every client.

    Parts: the overview (owner, connections, registrations), one per
    observed service and one per calling route (``"connection/service"``).
    A part's version moves only when its text changes.
    """

    seq: int
    taken_at: float
    overview: str
    overview_version: int
    #: service key -> (version, JSON text)
    services: Parts
    #: route key -> (version, JSON text)
    routes: Parts = field(default_factory=dict)
    #: service key -> (version, JSON number or null): when its listing was last
    #: confirmed (moves with every poll; kept out of the service's part).
    confirmed: Parts = field(default_factory=dict)
    #: ``"<service key>#<n>"`` -> (version, JSON list): the service's instances
    #: ``n * CHUNK`` to ``(n + 1) * CHUNK`` (the service part says how many).
    chunks: Parts = field(default_factory=dict)

    def delta(
        self,
        seen: dict[str, int],
        *,
        full: bool = False,
        now: float | None = None,
        sampled: float | None = None,
        interval: float = DEFAULT_INTERVAL,
    ) -> str | None:
        """The message bringing a client from ``seen`` to this sample (and
        update ``seen``); None when it already has everything.

        ``seen`` maps ``""`` to the overview's version, ``"s:<key>"`` and
        ``"r:<key>"`` to the versions of service and route parts (``"c:<key>"``
        to those of the confirmed-at times). Only the parts whose version
        moved are in the message, with their versions; a service part has no
        ``confirmed_at`` (it is in ``confirmed``: key -> loop-clock time) and
        no ``instances``: it has ``chunks`` (a count), and ``instances`` maps
        ``"<key>#<n>"`` to the changed chunks (``CHUNK`` instances each).
        ``now`` (server clock when sent) and ``sampled`` (when the owner was
        last read) let the client tell how old its data is."""
        services, versions, removed = _changed(self.services, "s:", seen, full)
        routes, route_versions, removed_routes = _changed(self.routes, "r:", seen, full)
        stamps, _versions, _removed = _changed(self.confirmed, "c:", seen, full)
        chunks, _versions, _removed = _changed(self.chunks, "i:", seen, full)
        overview = full or seen.get("") != self.overview_version
        if not (overview or services or removed or routes or removed_routes or stamps or chunks):
            return None
        seen[""] = self.overview_version
        kind = "full" if full else "delta"
        return (
            f'{{"type":"{kind}","seq":{self.seq},{self._clock(now, sampled, interval)},'
            + (f'"overview":{self.overview},' if overview else "")
            + f'"services":{{{",".join(services)}}},"versions":{{{",".join(versions)}}},'
            f'"removed":{_dumps(removed)},"confirmed":{{{",".join(stamps)}}},'
            f'"instances":{{{",".join(chunks)}}},'
            f'"routes":{{{",".join(routes)}}},'
            f'"route_versions":{{{",".join(route_versions)}}},'
            f'"removed_routes":{_dumps(removed_routes)}}}'
        )

    def tick(self, *, now: float, sampled: float, interval: float) -> str:
        """A message with no parts: only how old the client's data is."""
        return f'{{"type":"tick","seq":{self.seq},{self._clock(now, sampled, interval)}}}'

    def _clock(self, now: float | None, sampled: float | None, interval: float) -> str:
        at = self.taken_at if now is None else now
        last = self.taken_at if sampled is None else sampled
        stale_after = HEARTBEAT + 2 * interval + 1.0
        return (
            f'"now":{_dumps(_num(at))},"sampled":{_dumps(_num(last))},'
            f'"changed":{_dumps(_num(self.taken_at))},"interval":{_dumps(_num(interval))},'
            f'"stale_after":{_dumps(_num(stale_after))}'
        )


class ConsoleModel:
    """Samples an owner's observer into :class:`ConsoleSample` objects.

    ``services`` (keys ``"connection/service"``) limits what is shown; by
    default every observed service is. ``transports`` adds routes of
    transports built directly.

    Sampling: :meth:`run` samples every ``interval`` seconds until
    cancelled, whether or not a client is connected (the console's lifespan
    runs it inside the server's task group). Without it, :meth:`fresh`
    samples on demand and a waiting client samples for everyone, as before.
    """

    def __init__(
        self,
        observer: RuntimeObserver,
        *,
        interval: float = DEFAULT_INTERVAL,
        services: Sequence[str] | None = None,
        transports: Sequence[DiscoveryTransport] = (),
    ) -> None:
        if not isinstance(observer, RuntimeObserver):
            raise TypeError(f"ConsoleModel needs a RuntimeObserver, not {type(observer).__name__}")
        if isinstance(interval, bool) or not (
            isinstance(interval, int | float) and math.isfinite(interval) and interval > 0
        ):
            raise ValueError(f"interval must be a finite number of seconds > 0, got {interval!r}")
        self._observer = observer
        self.interval = float(interval)
        self._filter = frozenset(services) if services is not None else None
        self._transports = tuple(transports)
        self._seq = 0
        self._sample: ConsoleSample | None = None
        # key -> (cache key, version, text)
        self._parts: dict[str, tuple[object, int, str]] = {}
        self._routes: dict[str, tuple[int, str]] = {}
        self._confirmed: dict[str, tuple[int, str]] = {}
        # "<key>#<n>" -> (version, JSON list of instances); key -> chunk count
        self._chunks: dict[str, tuple[int, str]] = {}
        self._counts: dict[str, int] = {}
        # "<key>#<n>" -> the chunk's rows as last encoded (compared before encoding)
        self._rows: dict[str, tuple[tuple[str, str, float], ...]] = {}
        self._overview: tuple[str, int] = ("", 0)
        self._sampling = False
        self._event = anyio.Event()
        #: Samples taken (diagnostic).
        self.samples = 0
        #: When the owner was last read (loop clock), changed or not.
        self.sampled_at = -math.inf
        #: :meth:`run` loops sampling now.
        self.running = 0

    @property
    def current(self) -> ConsoleSample:
        """The newest sample (taking the first one on demand)."""
        sample = self._sample
        if sample is None:
            sample = self.resample()
        return sample

    def fresh(self) -> ConsoleSample:
        """The newest sample, taken again first when it is older than one
        interval (no sampler running, or it fell behind)."""
        if anyio.current_time() - self.sampled_at > self.interval:
            return self.resample()
        return self.current

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Sample every ``interval`` seconds (on the interval's grid) until cancelled."""
        self.running += 1
        try:
            self.resample()
            task_status.started()
            while True:
                now = anyio.current_time()
                await anyio.sleep_until((math.floor(now / self.interval) + 1) * self.interval)
                self.resample()
        finally:
            self.running -= 1

    def resample(self, now: float | None = None) -> ConsoleSample:
        """Take a sample now; the sequence number moves only when something changed."""
        at = anyio.current_time() if now is None else now
        self.samples += 1
        self.sampled_at = at
        snap = self._observer.snapshot()
        extra: list[RouteMetrics] = []
        for transport in self._transports:
            if not transport.closed:
                extra.extend(route_metrics(route) for route in transport.routes())
        changed = False
        services: dict[str, tuple[int, str]] = {}
        confirmed: dict[str, tuple[int, str]] = {}
        chunks: dict[str, tuple[int, str]] = {}
        for listing in self._observer.listings(at):
            key = f"{listing.connection}/{listing.service}"
            if self._filter is not None and key not in self._filter:
                continue
            # When the listing was last confirmed moves with every poll or
            # watch progress: a part of its own (a number), so the card's
            # version moves only when what it shows changed.
            stamp = _dumps(_num(listing.confirmed_at))
            old_stamp = self._confirmed.get(key)
            if old_stamp is None or old_stamp[1] != stamp:
                confirmed[key] = (old_stamp[0] + 1 if old_stamp else 1, stamp)
                changed = True
            else:
                confirmed[key] = old_stamp
            cache_key = (
                listing.revision,
                listing.confirmed_at is None,
                listing.unavailable_reason,
                listing.last_failure,
                listing.failure_reason,
                listing.degraded,
                listing.evidence,
                id(listing.instances),
            )
            known = self._parts.get(key)
            if known is not None and known[0] == cache_key:
                services[key] = (known[1], known[2])
                for n in range(self._counts.get(key, 0)):
                    mark = f"{key}#{n}"
                    chunks[mark] = self._chunks[mark]
                continue
            content = _listing_head(listing)
            # The instances in chunks of their own: one instance changing in a
            # large service resends its chunk, not the service. A chunk is
            # compared by its rows and encoded only when they changed.
            instances = listing.instances
            count = math.ceil(len(instances) / CHUNK)
            content["chunks"] = count
            for n in range(count):
                mark = f"{key}#{n}"
                part = instances[n * CHUNK : (n + 1) * CHUNK]
                rows = tuple((i.identity, i.address, i.weight) for i in part)
                old = self._chunks.get(mark)
                if old is not None and self._rows.get(mark) == rows:
                    chunks[mark] = old
                    continue
                chunk = _dumps([_instance_row(*row) for row in rows])
                self._rows[mark] = rows
                if old is not None and old[1] == chunk:
                    chunks[mark] = old
                else:
                    chunks[mark] = (old[0] + 1 if old is not None else 1, chunk)
                    changed = True
            self._counts[key] = count
            text = _dumps(content)
            if known is not None and known[2] == text:
                self._parts[key] = (cache_key, known[1], text)
                services[key] = (known[1], text)
                continue
            version = known[1] + 1 if known is not None else 1
            self._parts[key] = (cache_key, version, text)
            services[key] = (version, text)
            changed = True
        for key in [k for k in self._parts if k not in services]:
            del self._parts[key]
            self._counts.pop(key, None)
            changed = True
        if set(self._chunks) - set(chunks):
            changed = True
            for mark in set(self._chunks) - set(chunks):
                self._rows.pop(mark, None)
        self._chunks = chunks
        self._confirmed = confirmed
        routes: dict[str, tuple[int, str]] = {}
        for route in (*snap.routes, *extra):
            key = f"{route.connection}/{route.service}"
            if route.protocol != "http":
                # A gRPC channel's route of the same service: a card of its own.
                key = f"{key} ({route.protocol})"
            text = _dumps(_route_part(route))
            old = self._routes.get(key) or routes.get(key)
            if old is not None and old[1] == text:
                routes[key] = old
                continue
            routes[key] = (old[0] + 1 if old is not None else 1, text)
            changed = True
        if set(self._routes) - set(routes):
            changed = True
        self._routes = routes
        overview = _dumps(overview_part(snap))
        if overview != self._overview[0]:
            self._overview = (overview, self._overview[1] + 1)
            changed = True
        previous = self._sample
        if previous is None or changed:
            self._seq += 1
            self._sample = ConsoleSample(
                seq=self._seq,
                taken_at=at,
                overview=self._overview[0],
                overview_version=self._overview[1],
                services=services,
                routes=dict(routes),
                confirmed=confirmed,
                chunks=chunks,
            )
            event, self._event = self._event, anyio.Event()
            event.set()
        assert self._sample is not None
        return self._sample

    async def wait_newer(self, seq: int) -> ConsoleSample:
        """Wait for a sample newer than ``seq``; return the newest one.

        With :meth:`run` sampling, this sleeps on the change event. Without
        it, while no client samples, the caller samples every ``interval``
        seconds until something changed; the sampling role is given up when
        this returns (or is cancelled), and the other waiters are woken to
        take it over.
        """
        while True:
            sample = self.current
            if sample.seq > seq:
                return sample
            if self._sampling or self.running:
                await self._event.wait()
                continue
            self._sampling = True
            try:
                while self.current.seq <= seq and not self.running:
                    now = anyio.current_time()
                    tick = (math.floor(now / self.interval) + 1) * self.interval
                    await anyio.sleep_until(tick)
                    self.resample()
            finally:
                self._sampling = False
                event, self._event = self._event, anyio.Event()
                event.set()

    def __repr__(self) -> str:
        return f"<ConsoleModel interval={self.interval} seq={self._seq} running={self.running}>"
