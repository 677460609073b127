"""The catalog: one long-polling worker keeps an immutable snapshot of every service.

Consumers read the catalog instead of each issuing their own Consul query.
One :class:`ConsulCatalog` per connection (:func:`catalog_for` hands out the
same object every time) and :meth:`ConsulCatalog.run` is started once, in the
owner's task group.

One pass of the worker::

      +-- GET /v1/catalog/services?index=T&wait=W --+   first to advance wins;
      |                                             +-> the other is cancelled
      +-- GET /v1/health/state/any?index=H&wait=W --+   AND awaited here
                         |
                         v
      rebuild: GET /v1/catalog/services (fresh)
               + GET /v1/health/service/<name>?passing for every name
               -> immutable CatalogSnapshot -> LatestCell.publish (atomic swap)

Watching the health index means a peer going critical -> passing wakes a
rebuild within one blocking round trip even though no service was added or
removed. The cancelled query re-issues with its unchanged index next pass,
so no change is lost, and its connection is released before the pass ends.

A failed pass keeps the last snapshot, records the error and retries with
backoff; a rebuild that produces an equal snapshot publishes nothing.

One service's trouble does not cost the others their entries. A per-service
read that fails in a way that concerns only that service is recorded in
``CatalogStatistics.rejected`` (name -> reason) and the rest publishes::

    InvalidSnapshot   (only invalid candidates)      -> ()  (never served)
    CapacityRejected  (over max_instances_per_service
                       or max_response_bytes)        -> that service's previous
                                                        instances, else ()
    AclFiltered       (token lacks service:read)     -> left out of the snapshot

Anything else (transport, 5xx, an unknown token's 403) fails the pass.
``/v1/catalog/services`` itself is read as Consul filters it: a
least-privilege token sees only what it may read, which is normal there and
never a revocation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import anyio
from anyio.abc import TaskStatus

from nadisc import CapacityRejected, Instance, InvalidSnapshot, LifecycleError, ProviderFailure
from poise import CellReader, LatestCell, Subscription

from ._blocking import BlockingCursor, IndexOutcome, TokenBucket, read_timeout
from ._http import AclFiltered
from ._provider import COOPERATIVE_BYTES, ConsulProvider
from ._wire import (
    decode_catalog_services,
    decode_health_state,
    decode_health_state_cooperatively,
    parse_index,
)

__all__ = [
    "CatalogSnapshot",
    "CatalogStatistics",
    "ConsulCatalog",
    "DiscoveredService",
    "ResolvedEndpoint",
    "catalog_for",
]

logger = logging.getLogger(__name__)

_EMPTY: Mapping[str, tuple[Instance, ...]] = MappingProxyType({})
_NO_REJECTIONS: Mapping[str, str] = MappingProxyType({})

Query = Literal["topology", "health"]


@dataclass(frozen=True, slots=True)
class ResolvedEndpoint:
    """One healthy endpoint of a service, as :meth:`ConsulCatalog.resolve` picked it."""

    service: str
    instance: Instance

    @property
    def host(self) -> str:
        return self.instance.host

    @property
    def port(self) -> int:
        return self.instance.port

    @property
    def address(self) -> str:
        return self.instance.address


@dataclass(frozen=True, slots=True)
class DiscoveredService:
    """A service and the instances of it that matched a :meth:`ConsulCatalog.list` filter."""

    name: str
    instances: tuple[Instance, ...]


@dataclass(frozen=True, slots=True)
class CatalogSnapshot:
    """Every known service and its passing instances, at one moment. Immutable."""

    services: Mapping[str, tuple[Instance, ...]] = field(default_factory=lambda: _EMPTY)
    topology_index: int = 0
    health_index: int = 0
    #: Event-loop time the snapshot was assembled.
    built_at: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.services, MappingProxyType):
            object.__setattr__(self, "services", MappingProxyType(dict(self.services)))


@dataclass(frozen=True, slots=True)
class CatalogStatistics:
    running: bool
    passes: int
    rebuilds: int
    publishes: int
    topology_wins: int
    health_wins: int
    cancelled_losers: int
    failures: int
    queries_in_flight: int
    services: int
    last_error: str | None
    #: Services the last rebuild could not read on their own (name -> reason);
    #: the rest of that rebuild was published.
    rejected: Mapping[str, str] = field(default_factory=lambda: _NO_REJECTIONS)
    #: Per-service rejections over the catalog's life.
    rejections: int = 0


class ConsulCatalog:
    """An in-memory, blocking-query-refreshed view of a Consul catalog.

    ``resolve`` and ``list`` are synchronous reads of the current snapshot;
    ``changes()`` subscribes to swaps (latest only: a slow reader sees the
    newest snapshot, never a backlog).
    """

    def __init__(self, provider: ConsulProvider) -> None:
        self._provider = provider
        self._cell: LatestCell[CatalogSnapshot] = LatestCell(CatalogSnapshot())
        self._state: Literal["new", "running", "stopped"] = "new"
        self._round_robin: dict[str, int] = {}
        self._passes = 0
        self._rebuilds = 0
        self._publishes = 0
        self._wins = {"topology": 0, "health": 0}
        self._cancelled_losers = 0
        self._failures = 0
        self._in_flight = 0
        self._last_error: str | None = None
        self._rejected: Mapping[str, str] = _NO_REJECTIONS
        self._rejections = 0

    def __repr__(self) -> str:
        snapshot = self._cell.get()
        return (
            f"<ConsulCatalog {self._state} services={len(snapshot.services)} "
            f"revision={self._cell.revision}>"
        )

    # -- reading ---------------------------------------------------------------
    def snapshot(self) -> CatalogSnapshot:
        """The current snapshot (one atomic read)."""
        return self._cell.get()

    def reader(self) -> CellReader[CatalogSnapshot]:
        return self._cell.reader()

    def changes(self) -> Subscription[CatalogSnapshot]:
        """Snapshots published after now (latest only)."""
        return self._cell.reader().changes()

    def resolve(self, name: str) -> ResolvedEndpoint | None:
        """One healthy endpoint of ``name``, round robin across every instance
        of the name (tags and meta ignored); None when there is none."""
        instances = self._cell.get().services.get(name)
        if not instances:
            return None
        position = self._round_robin.get(name, 0) % len(instances)
        self._round_robin[name] = position + 1
        return ResolvedEndpoint(name, instances[position])

    def list(
        self, tag: str | None = None, meta_match: Mapping[str, str] | None = None
    ) -> tuple[DiscoveredService, ...]:
        """Services filtered at instance granularity: an instance contributes
        only if it, alone, carries ``tag`` and matches every ``meta_match`` pair.
        Services with no matching instance are left out. Sorted by name."""
        pairs = tuple((meta_match or {}).items())
        found: list[DiscoveredService] = []
        services = self._cell.get().services
        for name in sorted(services):
            matched = tuple(
                instance
                for instance in services[name]
                if (tag is None or tag in instance.tags)
                and all(instance.metadata.get(k) == v for k, v in pairs)
            )
            if matched:
                found.append(DiscoveredService(name, matched))
        return tuple(found)

    def statistics(self) -> CatalogStatistics:
        return CatalogStatistics(
            running=self._state == "running",
            passes=self._passes,
            rebuilds=self._rebuilds,
            publishes=self._publishes,
            topology_wins=self._wins["topology"],
            health_wins=self._wins["health"],
            cancelled_losers=self._cancelled_losers,
            failures=self._failures,
            queries_in_flight=self._in_flight,
            services=len(self._cell.get().services),
            last_error=self._last_error,
            rejected=self._rejected,
            rejections=self._rejections,
        )

    # -- the worker ------------------------------------------------------------
    async def run(
        self, *, task_status: TaskStatus[ConsulCatalog] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep the snapshot converged until cancelled. Starts once per catalog.

        ``task_status.started(self)`` is called after the first build attempt,
        so the snapshot is filled when Consul is reachable (and the error is in
        :meth:`statistics` when it is not).
        """
        if self._state != "new":
            raise LifecycleError(f"the catalog is already {self._state}; it runs once")
        self._state = "running"
        provider = self._provider
        cursors: dict[Query, BlockingCursor] = {
            "topology": BlockingCursor(),
            "health": BlockingCursor(),
        }
        buckets: dict[Query, TokenBucket] = {
            "topology": provider.new_bucket(),
            "health": provider.new_bucket(),
        }
        backoff = provider.new_backoff()
        started = False
        try:
            while True:
                try:
                    if any(c.index == 0 for c in cursors.values()):
                        await self._prime(cursors)
                    await self._rebuild(cursors)
                    backoff.succeeded()
                    if not started:
                        started = True
                        task_status.started(self)
                    await self._race(cursors, buckets)
                except ProviderFailure as failure:
                    self._failures += 1
                    self._last_error = str(failure)
                    logger.warning("consul catalog pass failed: %s", failure)
                    if not started:
                        started = True
                        task_status.started(self)
                    await anyio.sleep(backoff.next_delay(provider.unit_random()))
        finally:
            self._state = "stopped"
            self._cell.close()

    async def _read(self, query: Query, index: int | None) -> tuple[bytes, int]:
        provider = self._provider
        wait = provider.settings.catalog_wait
        margin = provider.context.request_timeout
        path = "/v1/catalog/services" if query == "topology" else "/v1/health/state/any"
        budget = read_timeout(wait, margin) if index is not None else margin
        self._in_flight += 1
        try:
            response = await provider.http.get(
                path,
                provider.read_params(index=index, wait=wait),
                budget=budget,
                what=f"GET {path}",
            )
        finally:
            self._in_flight -= 1
        new_index = parse_index(response.headers.get("x-consul-index"), what=f"GET {path}")
        if query == "topology":
            decode_catalog_services(response.body)
        elif len(response.body) > COOPERATIVE_BYTES:
            await decode_health_state_cooperatively(response.body)
        else:
            decode_health_state(response.body)
        return response.body, new_index

    async def _prime(self, cursors: Mapping[Query, BlockingCursor]) -> None:
        """Non-blocking reads of both queries, to learn their indexes."""
        failures: list[ProviderFailure] = []

        async def read(query: Query) -> None:
            try:
                _, index = await self._read(query, None)
            except ProviderFailure as failure:
                failures.append(failure)
                return
            cursors[query].reset()
            cursors[query].observe(index)

        async with anyio.create_task_group() as group:
            for query in cursors:
                group.start_soon(read, query)
        if failures:
            raise failures[0]

    async def _race(
        self, cursors: Mapping[Query, BlockingCursor], buckets: Mapping[Query, TokenBucket]
    ) -> None:
        """Both blocking queries; returns when one advanced or its index went
        backwards (the caller then re-primes: that cursor is back at 0). The
        loser is cancelled and awaited before this returns: its connection is
        released and its index is unchanged."""
        self._passes += 1
        winners: list[tuple[Query, IndexOutcome]] = []
        failures: list[ProviderFailure] = []

        async def racer(query: Query, scope: anyio.CancelScope) -> None:
            cursor = cursors[query]
            while True:
                delay = buckets[query].reserve(anyio.current_time())
                if delay > 0:
                    await anyio.sleep(delay)
                try:
                    _, index = await self._read(query, cursor.request_index())
                except ProviderFailure as failure:
                    failures.append(failure)
                    scope.cancel()
                    return
                outcome = cursor.observe(index)
                if outcome is IndexOutcome.UNCHANGED:
                    continue
                winners.append((query, outcome))
                scope.cancel()
                return

        async with anyio.create_task_group() as group:
            for query in cursors:
                group.start_soon(racer, query, group.cancel_scope)
        self._cancelled_losers += len(cursors) - len(winners) - len(failures)
        for query, _ in winners:
            self._wins[query] += 1
        if failures:
            raise failures[0]

    async def _rebuild(self, cursors: Mapping[Query, BlockingCursor]) -> None:
        provider = self._provider
        budget = provider.context.request_timeout
        response = await provider.http.get(
            "/v1/catalog/services",
            provider.read_params(),
            budget=budget,
            what="GET /v1/catalog/services",
        )
        names = decode_catalog_services(response.body)
        previous = self._cell.get().services
        services: dict[str, tuple[Instance, ...]] = {}
        rejected: dict[str, str] = {}
        failures: list[ProviderFailure] = []
        limiter = anyio.CapacityLimiter(provider.settings.catalog_parallelism)

        async def fetch(name: str, scope: anyio.CancelScope) -> None:
            async with limiter:
                try:
                    snapshot, _ = await provider.read_health(name, budget=budget)
                except InvalidSnapshot as failure:
                    # Only invalid candidates: nothing usable, but the pass is complete.
                    logger.info("catalog: %s", failure)
                    rejected[name] = f"invalid: {failure}"
                    services[name] = ()
                    return
                except CapacityRejected as failure:
                    logger.warning("catalog: %s", failure)
                    rejected[name] = f"capacity: {failure}"
                    services[name] = previous.get(name, ())
                    return
                except AclFiltered as failure:
                    logger.info("catalog: %s", failure)
                    rejected[name] = f"filtered: {failure}"
                    return
                except ProviderFailure as failure:
                    failures.append(failure)
                    scope.cancel()
                    return
            services[name] = snapshot.instances

        async with anyio.create_task_group() as group:
            for name in names:
                group.start_soon(fetch, name, group.cancel_scope)
        if failures:
            raise failures[0]
        self._rejected = MappingProxyType(dict(sorted(rejected.items())))
        self._rejections += len(rejected)
        self._rebuilds += 1
        ordered = {name: services[name] for name in sorted(services)}
        if self._publishes and dict(self._cell.get().services) == ordered:
            return
        snapshot = CatalogSnapshot(
            services=ordered,
            topology_index=cursors["topology"].index,
            health_index=cursors["health"].index,
            built_at=anyio.current_time(),
        )
        self._cell.publish(snapshot)
        self._publishes += 1


def catalog_for(provider: ConsulProvider) -> ConsulCatalog:
    """The one catalog of ``provider``'s connection (the same object every call;
    its :meth:`ConsulCatalog.run` starts once)."""
    if provider.catalog is None:
        provider.catalog = ConsulCatalog(provider)
    return provider.catalog
