"""Test support: :class:`MemoryProvider`, an in-memory registry backend.

Tests and hosts set complete listings, inject every failure kind the
evidence rules distinguish, slow queries down, switch watch mode on or off
and count what the owner asked for::

    provider = MemoryProvider(services={"orders": "order-worker"})
    provider.set("order-worker", [Instance("a", "10.0.0.1", 80)])
    provider.fail("order-worker", IncompleteSnapshot("paging broke"), times=1)

Registration calls are delegated to an optional ``registry`` object with the
same method shapes as :class:`~nadisc.Provider` (``register``, ``renew``,
``check``, ``deregister``; its ``idempotent_renewal``, ``idempotent_register`` and
``deregister_without_handle`` attributes are honoured):
anything satisfying :class:`RegistryBackend`, usually the in-memory
:class:`MemoryRegistry` re-exported here with its :class:`Fault` scripts::

    registry = MemoryRegistry(idempotent_renewal=True)
    provider = MemoryProvider(services={"self": "order-api"}, registry=registry)
    registry.inject("renew", Fault.lose_ack())

Without a registry, ``capabilities.registration`` is False and the calls are
rejected.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus

from ._errors import IncompleteSnapshot, ProviderFailure, RegistrationRejected
from ._instance import EvidenceKind, Instance, ProviderSnapshot
from ._memory_registry import Fault, FaultKind, MemoryRegistry
from ._provider import (
    Capabilities,
    HealthStatus,
    ObservationSink,
    Registered,
    RegistrationRecord,
)

__all__ = ["Fault", "FaultKind", "MemoryProvider", "MemoryRegistry", "RegistryBackend"]


class RegistryBackend(Protocol):
    """What :class:`MemoryProvider` delegates registration calls to
    (:class:`MemoryRegistry` is one)."""

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered: ...

    async def renew(self, registered: Registered, deadline: float) -> Registered: ...

    async def check(self, registered: Registered, deadline: float) -> HealthStatus: ...

    async def deregister(self, registered: Registered, deadline: float) -> None: ...


@dataclass
class _Fault:
    failure: ProviderFailure
    #: Remaining queries to fail (None: until cleared).
    remaining: int | None


@dataclass(eq=False)
class _Watch:
    sink: ObservationSink
    wake: anyio.Event = field(default_factory=anyio.Event)
    end: bool = False
    failure: ProviderFailure | None = None


class MemoryProvider:
    """An in-memory provider with fault injection and counters."""

    def __init__(
        self,
        *,
        services: Mapping[str, str] | None = None,
        evidence: EvidenceKind = EvidenceKind.REGISTRY_HEALTH,
        watch: bool = False,
        watch_streams: int = 1,
        latency: float = 0.0,
        registry: RegistryBackend | None = None,
    ) -> None:
        if watch_streams < 1:
            raise ValueError("watch_streams must be >= 1 (use watch=False for none)")
        self._bindings = dict(services) if services is not None else None
        self._evidence = evidence
        self._watch = watch
        self._watch_streams = watch_streams
        self._latency = latency
        self._latencies: dict[str, float] = {}
        self._registry = registry
        self._listings: dict[str, ProviderSnapshot] = {}
        self._malformed: dict[str, object] = {}
        self._faults: dict[str, _Fault] = {}
        self._prepare_failure: BaseException | None = None
        self._prepare_latency = 0.0
        self._watches: dict[str, list[_Watch]] = {}
        #: Queries started, per remote service name.
        self.query_counts: Counter[str] = Counter()
        #: Watches started, per remote service name.
        self.watch_counts: Counter[str] = Counter()
        self.prepare_calls = 0
        self.close_calls = 0

    # ------------------------------------------------------------------ listings

    def bindings(self) -> Mapping[str, str]:
        """alias -> remote: as given, else every listed service bound to itself."""
        if self._bindings is not None:
            return dict(self._bindings)
        return {name: name for name in self._listings}

    def set(
        self,
        service: str,
        instances: Iterable[Instance],
        *,
        invalid: Mapping[str, str] | None = None,
        evidence: EvidenceKind | None = None,
    ) -> ProviderSnapshot:
        """Make ``instances`` the complete listing of ``service`` (watches see it now)."""
        snapshot = ProviderSnapshot(
            service=service,
            instances=tuple(instances),
            evidence=evidence or self._evidence,
            invalid=dict(invalid or {}),
        )
        self._listings[service] = snapshot
        self._malformed.pop(service, None)
        for watch in self._watches.get(service, ()):
            watch.sink.publish(snapshot)
        return snapshot

    def set_empty(self, service: str) -> ProviderSnapshot:
        """The registry explicitly lists no instances of ``service``."""
        return self.set(service, ())

    def set_malformed(self, service: str, value: object) -> None:
        """Queries of ``service`` return ``value`` (not a listing) until ``set``."""
        self._malformed[service] = value

    def listing(self, service: str) -> ProviderSnapshot:
        return self._listings.get(service) or ProviderSnapshot(service, (), self._evidence)

    # ------------------------------------------------------------------ faults

    def fail(
        self, service: str, failure: ProviderFailure | None, *, times: int | None = None
    ) -> None:
        """Queries of ``service`` raise ``failure`` (``times`` queries, or until
        cleared with ``fail(service, None)``)."""
        if failure is None:
            self._faults.pop(service, None)
        else:
            self._faults[service] = _Fault(failure, times)

    def fail_prepare(self, failure: BaseException | None) -> None:
        """``prepare`` raises ``failure`` (None: succeeds again)."""
        self._prepare_failure = failure

    def set_latency(self, seconds: float, service: str | None = None) -> None:
        """Every query (or queries of ``service``) take ``seconds`` first."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError("latency must be a finite number >= 0")
        if service is None:
            self._latency = seconds
        else:
            self._latencies[service] = seconds

    def set_prepare_latency(self, seconds: float) -> None:
        """``prepare`` takes ``seconds`` first."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError("latency must be a finite number >= 0")
        self._prepare_latency = seconds

    def set_watch(self, enabled: bool) -> None:
        """Switch watch mode for observations started from now on."""
        self._watch = enabled

    def watch_fail(self, service: str, failure: ProviderFailure) -> None:
        """Active watches of ``service`` report ``failure`` and keep running."""
        for watch in self._watches.get(service, ()):
            watch.sink.fail(failure)

    def watch_refresh(self, service: str) -> None:
        """Active watches of ``service`` confirm that nothing changed."""
        for watch in self._watches.get(service, ()):
            watch.sink.refresh()

    def end_watches(self, service: str, failure: ProviderFailure | None = None) -> None:
        """Active watches of ``service`` stop (raising ``failure`` if given)."""
        for watch in self._watches.get(service, ()):
            watch.end = True
            watch.failure = failure
            watch.wake.set()

    def active_watches(self, service: str) -> int:
        return len(self._watches.get(service, ()))

    # ------------------------------------------------------------------ provider

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            evidence=self._evidence,
            registration=self._registry is not None,
            watch_streams=self._watch_streams if self._watch else 0,
            idempotent_renewal=bool(getattr(self._registry, "idempotent_renewal", False)),
            idempotent_register=bool(getattr(self._registry, "idempotent_register", False)),
            deregister_without_handle=bool(
                getattr(self._registry, "deregister_without_handle", False)
            ),
        )

    async def prepare(self, deadline: float) -> None:
        self.prepare_calls += 1
        if self._prepare_latency > 0:
            await anyio.sleep(self._prepare_latency)
        else:
            await anyio.lowlevel.checkpoint()
        if self._prepare_failure is not None:
            raise self._prepare_failure

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        self.query_counts[service] += 1
        latency = self._latencies.get(service, self._latency)
        if latency > 0:
            await anyio.sleep(latency)
        else:
            await anyio.lowlevel.checkpoint()
        fault = self._faults.get(service)
        if fault is not None:
            if fault.remaining is not None:
                fault.remaining -= 1
                if fault.remaining <= 0:
                    del self._faults[service]
            raise fault.failure
        if service in self._malformed:
            return self._malformed[service]  # type: ignore[return-value]
        return self.listing(service)

    async def watch(
        self, service: str, sink: ObservationSink, *, task_status: TaskStatus[None]
    ) -> None:
        self.watch_counts[service] += 1
        watch = _Watch(sink)
        self._watches.setdefault(service, []).append(watch)
        try:
            task_status.started()
            # A real watch starts from a listing (etcd's range, Kubernetes'
            # list): report the one of now, so a set() made between the
            # owner's first query and this start is not lost.
            current = self._listings.get(service)
            if current is not None:
                sink.publish(current)
            while not watch.end:
                await watch.wake.wait()
                watch.wake = anyio.Event()
            if watch.failure is not None:
                raise watch.failure
        finally:
            self._watches[service].remove(watch)

    def _need_registry(self) -> RegistryBackend:
        if self._registry is None:
            raise RegistrationRejected("this memory provider has no registry")
        return self._registry

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        return await self._need_registry().register(record, deadline)

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        return await self._need_registry().renew(registered, deadline)

    async def check(self, registered: Registered, deadline: float) -> HealthStatus:
        return await self._need_registry().check(registered, deadline)

    async def deregister(self, registered: Registered, deadline: float) -> None:
        await self._need_registry().deregister(registered, deadline)

    async def aclose(self) -> None:
        self.close_calls += 1
        for watches in self._watches.values():
            for watch in watches:
                watch.end = True
                watch.failure = IncompleteSnapshot("the provider closed")
                watch.wake.set()

    def __repr__(self) -> str:
        return (
            f"<MemoryProvider listings={len(self._listings)} "
            f"queries={sum(self.query_counts.values())}>"
        )
