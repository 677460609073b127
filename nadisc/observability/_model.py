"""The console's state model: observer reads turned into versioned JSON parts.

Contract: :class:`ConsoleModel` turns the observer's ``snapshot()`` and
``listings()`` into JSON text, split into parts that change independently:
one part per observed service (``"<connection>/<service>"``: revision,
evidence kind, confirmed-at time, ``max_age``, failure, instances) and one
"overview" part (owner, connections, registrations with their history,
routes). Every part has a version that moves only when its text changes.

Latest-only delivery: a client remembers the versions it has seen;
:meth:`ConsoleSample.delta` gives the message that brings *that* client from
what it saw to the newest sample, whatever happened in between, so a slow
client skips intermediate states instead of queueing them. Memory per
client: one version per service, never a queue of messages.

Sampling, change-driven by ticks: :meth:`ConsoleModel.wait_newer` lets
one waiting client at a time sample every ``interval`` seconds (the others
sleep on one event); a sample whose parts all kept their versions wakes
nobody. No task is started: sampling runs inside a client's own handler
(the host's server task group).

Costs per sample: O(services + registrations + route endpoints) while
listings are unchanged; a changed service is re-encoded once (O(its
instances)) and shared by every client. Per client per update: O(services)
to compare versions, plus the bytes of what changed.

What is shown: configured connection, service and registration names,
closed states, instance identities and addresses, weights, ages and
counters. Never metadata, tags, tokens or passwords (the observer does not
hand them out).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

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


def service_part(listing: ServiceListing) -> dict[str, Any]:
    return {
        "connection": listing.connection,
        "service": listing.service,
        "revision": listing.revision,
        "evidence": listing.evidence,
        "confirmed_at": _num(listing.confirmed_at),
        "max_age": listing.max_age,
        "degraded": listing.degraded,
        "unavailable": listing.unavailable_reason,
        "last_failure": listing.last_failure,
        "instances": [
            {"identity": i.identity, "address": i.address, "weight": i.weight}
            for i in listing.instances
        ],
    }


def _route_part(route: RouteMetrics) -> dict[str, Any]:
    return {
        "connection": route.connection,
        "service": route.service,
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


def overview_part(snap: ObserverSnapshot, extra: Sequence[RouteMetrics]) -> dict[str, Any]:
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
        "routes": [_route_part(r) for r in (*snap.routes, *extra)],
    }


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)


@dataclass(frozen=True, slots=True)
class ConsoleSample:
    """One sample: versioned JSON parts. Immutable; shared by every client."""

    seq: int
    taken_at: float
    overview: str
    overview_version: int
    #: service key -> (version, JSON text)
    services: Mapping[str, tuple[int, str]]

    def delta(self, seen: dict[str, int], *, full: bool = False) -> str | None:
        """The message bringing a client from ``seen`` to this sample (and
        update ``seen``); None when it already has everything. ``seen`` uses
        the key ``""`` for the overview part."""
        parts: list[str] = []
        changed = full or seen.get("") != self.overview_version
        for key, (version, text) in self.services.items():
            if full or seen.get(key) != version:
                parts.append(f"{_dumps(key)}:{text}")
                seen[key] = version
        removed = [key for key in seen if key and key not in self.services]
        for key in removed:
            del seen[key]
        if not (changed or parts or removed):
            return None
        seen[""] = self.overview_version
        kind = "full" if full else "delta"
        return (
            f'{{"type":"{kind}","seq":{self.seq},"now":{_dumps(_num(self.taken_at))},'
            f'"overview":{self.overview},"services":{{{",".join(parts)}}},'
            f'"removed":{_dumps(removed)}}}'
        )


class ConsoleModel:
    """Samples an owner's observer into :class:`ConsoleSample` objects.

    ``services`` (keys ``"connection/service"``) limits what is shown; by
    default every observed service is. ``transports`` adds routes of
    transports built directly.
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
        self._overview: tuple[str, int] = ("", 0)
        self._sampling = False
        self._event = anyio.Event()
        #: Samples taken (diagnostic).
        self.samples = 0

    @property
    def current(self) -> ConsoleSample:
        """The newest sample (taking the first one on demand)."""
        sample = self._sample
        if sample is None:
            sample = self.resample()
        return sample

    def resample(self, now: float | None = None) -> ConsoleSample:
        """Take a sample now; the sequence number moves only when something changed."""
        at = anyio.current_time() if now is None else now
        self.samples += 1
        snap = self._observer.snapshot()
        extra: list[RouteMetrics] = []
        for transport in self._transports:
            if not transport.closed:
                extra.extend(route_metrics(route) for route in transport.routes())
        changed = False
        services: dict[str, tuple[int, str]] = {}
        for listing in self._observer.listings(at):
            key = f"{listing.connection}/{listing.service}"
            if self._filter is not None and key not in self._filter:
                continue
            cache_key = (
                listing.revision,
                listing.confirmed_at,
                listing.unavailable_reason,
                listing.last_failure,
                listing.degraded,
                listing.evidence,
                id(listing.instances),
            )
            known = self._parts.get(key)
            if known is not None and known[0] == cache_key:
                services[key] = (known[1], known[2])
                continue
            text = _dumps(service_part(listing))
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
            changed = True
        overview = _dumps(overview_part(snap, extra))
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
            )
            event, self._event = self._event, anyio.Event()
            event.set()
        assert self._sample is not None
        return self._sample

    async def wait_newer(self, seq: int) -> ConsoleSample:
        """Wait for a sample newer than ``seq``; return the newest one.

        While no client samples, the caller samples every ``interval``
        seconds until something changed; otherwise it sleeps on the change
        event. The sampling role is given up when this returns (or is
        cancelled), and the other waiters are woken to take it over.
        """
        while True:
            sample = self.current
            if sample.seq > seq:
                return sample
            if self._sampling:
                await self._event.wait()
                continue
            self._sampling = True
            try:
                while self.current.seq <= seq:
                    now = anyio.current_time()
                    tick = (math.floor(now / self.interval) + 1) * self.interval
                    await anyio.sleep_until(tick)
                    self.resample()
                return self.current
            finally:
                self._sampling = False
                event, self._event = self._event, anyio.Event()
                event.set()

    def __repr__(self) -> str:
        return f"<ConsoleModel interval={self.interval} seq={self._seq}>"
