"""Named connections and the handles callers use to observe through them.

A :class:`Connection` is one provider, one frozen policy
(:class:`~nadisc.ConnectionConfig`), one set of service bindings (alias ->
remote name) and the observation slots of that connection. Connections are
independent: a failing connection never borrows another connection's
listing of a service with the same alias, and nothing here falls back.

A :class:`DiscoveryHandle` is what ``owner.client(qualifier)`` returns: it can
observe, nothing else (no close rights).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.lowlevel

from ._capacity import SnapshotLedger, StreamTicket, TaskBudget, WatchStreams
from ._config import block_secrets, provider_block
from ._errors import CapacityExceeded, DeadlineExceeded, UnknownService
from ._observation import (
    Observation,
    Slot,
    check_deadline,
    loop_clock,
    loop_event_and_deadline,
)
from ._redact import redacted_excerpt

if TYPE_CHECKING:
    from ._config import ConnectionConfig
    from ._provider import Provider

__all__ = ["Connection", "ConnectionStats", "DiscoveryHandle", "Runtime"]

#: Upper bounds (seconds) of the query latency histogram buckets; the last is +inf.
LATENCY_BUCKETS: tuple[float, ...] = (0.005, 0.025, 0.1, 0.5, 2.5, math.inf)


@dataclass(slots=True)
class ConnectionStats:
    """Mutable counters of one connection (read through the observer)."""

    queries: int = 0
    failures: int = 0
    invalid_records: int = 0
    capacity_rejections: int = 0
    #: Times an observation of this connection saw its identity revoked.
    identity_revocations: int = 0
    latency_last: float = 0.0
    latency_total: float = 0.0
    latency_max: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    #: Failed refreshes by closed failure kind (``FailureKind`` values).
    failure_kinds: dict[str, int] = field(default_factory=dict)

    def record_failure(self, kind: str) -> None:
        self.failures += 1
        self.failure_kinds[kind] = self.failure_kinds.get(kind, 0) + 1

    def record_query(self, seconds: float) -> None:
        self.queries += 1
        self.latency_last = seconds
        self.latency_total += seconds
        self.latency_max = max(self.latency_max, seconds)
        for index, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_buckets[index] += 1
                break


class Runtime(Protocol):
    """What connections need from their owner."""

    ledger: SnapshotLedger
    streams: WatchStreams
    tasks: TaskBudget
    #: Tasks of ours alive right now (slot and watch tasks).
    live_tasks: int
    max_service_watches: int

    def check_observable(self) -> None:
        """Raise ``LifecycleError`` unless observations may be started now."""

    async def start_slot(self, slot: Slot) -> None:
        """Start ``slot.run`` in the owner's task group (the slot exists first)."""

    def identity_revoked(self, connection: str) -> None:
        """A refresh of ``connection`` reported its identity revoked."""


class Connection:
    """One named connection: provider, policy, bindings and slots."""

    _secrets: tuple[str, ...] | None

    def redacted(self, text: str) -> str:
        """``text`` made safe to show: at most 200 characters, this
        connection's own secrets and any credential-looking value cut out
        (for prepare and refresh failure reasons)."""
        if self._secrets is None:
            self._secrets = block_secrets(provider_block(self.policy))
        return redacted_excerpt(text, self._secrets)

    def __init__(
        self,
        name: str,
        provider: Provider,
        policy: ConnectionConfig,
        bindings: Mapping[str, str],
        runtime: Runtime,
    ) -> None:
        self.name = name
        self.provider = provider
        self.policy = policy
        self.bindings: Mapping[str, str] = MappingProxyType(dict(bindings))
        self.runtime = runtime
        self.slots: dict[str, Slot] = {}
        self.stats = ConnectionStats()
        #: None: not prepared yet; True: prepared; False: prepare failed.
        self.prepared: bool | None = None
        #: Why prepare failed: a short reason with this connection's secrets
        #: and credential-looking values redacted (None: no failure).
        self.prepare_error: str | None = None
        #: The closed kind of that failure: the provider failure's class name,
        #: ``ProviderRaised`` or ``DeadlineExceeded`` (None: no failure).
        self.prepare_error_kind: str | None = None
        self._secrets: tuple[str, ...] | None = None
        # The event loop's clock, resolved on the first observe().
        self._clock: Callable[[], float] | None = None
        self._move_on_at: Callable[[float], contextlib.AbstractContextManager[object]] = (
            anyio.move_on_at
        )
        #: The one stream ticket of a provider whose watches share their
        #: streams (``Capabilities.shared_watch``), and how many slots hold it.
        self._shared_ticket: StreamTicket | None = None
        self._shared_holders = 0

    def request_watch_streams(self, streams: int, *, shared: bool) -> StreamTicket:
        """A slot's stream ticket. Shared watches (one stream for every watched
        service of the connection) take one ticket for the whole connection,
        requested by the first watching slot and given back by the last, so
        ``max_watch_streams`` counts the streams the provider really holds."""
        if not shared:
            return self.runtime.streams.request(streams)
        if self._shared_ticket is None:
            self._shared_ticket = self.runtime.streams.request(streams)
        self._shared_holders += 1
        return self._shared_ticket

    def release_watch_streams(self, ticket: StreamTicket) -> None:
        """Give a slot's ticket back (a shared one once its last holder leaves)."""
        if ticket is not self._shared_ticket:
            self.runtime.streams.release(ticket)
            return
        self._shared_holders -= 1
        if self._shared_holders == 0:
            self._shared_ticket = None
            self.runtime.streams.release(ticket)

    @property
    def request_timeout(self) -> float:
        return self.policy.request_timeout_ms / 1000.0

    def remote_name(self, alias: str) -> str:
        if not isinstance(alias, str):
            raise UnknownService(f"a service alias is a string, not {type(alias).__name__}")
        try:
            return self.bindings[alias]
        except KeyError:
            raise UnknownService(
                f"service {alias!r} is not bound on connection {self.name!r}"
            ) from None

    async def observe(self, alias: str, deadline: float | None = None) -> Observation:
        clock = self._clock
        if clock is None:
            clock = self._clock = loop_clock()[0]
            self._move_on_at = loop_event_and_deadline()[1]
        if deadline is not None:
            check_deadline(deadline, clock())
        self.runtime.check_observable()
        remote = self.remote_name(alias)
        slot = self.slots.get(alias)
        if slot is None or slot.reclaiming:
            slot = await self._new_slot(alias, remote)
        now = clock()
        slot.touch(now)
        observation = Observation(slot)
        if slot.first_outcome.is_set():
            await anyio.lowlevel.checkpoint()
        elif deadline is None:
            await slot.first_outcome.wait()  # bounded by the caller's cancel scope
        else:
            with self._move_on_at(deadline):
                await slot.first_outcome.wait()
        now = clock()
        if deadline is not None and now >= deadline:
            raise DeadlineExceeded(
                f"connection {self.name!r} service {alias!r}: the deadline passed "
                "before the first listing"
            )
        # The caller has seen what observe() returned: changes start from here.
        observation._seen = slot.state_key(now)
        return observation

    async def _new_slot(self, alias: str, remote: str) -> Slot:
        runtime = self.runtime
        if len(self.slots) >= runtime.max_service_watches:
            raise CapacityExceeded(
                "max_service_watches_per_connection",
                f"connection {self.name!r} already observes {len(self.slots)} services",
            )
        slot = Slot(self, alias, remote)
        runtime.tasks.acquire(slot.task_cost)
        self.slots[alias] = slot
        try:
            # Shielded: the task calls started() before its first checkpoint, so
            # this returns promptly; a caller cancelled here must not take the
            # slot's task (and everybody else's demand) down with it.
            with anyio.CancelScope(shield=True):
                await runtime.start_slot(slot)
        except BaseException:
            if self.slots.get(alias) is slot:
                del self.slots[alias]
            if not slot.reclaimed:
                slot.reclaimed = True
                runtime.tasks.release(slot.task_cost)
            slot.close()
            raise
        return slot

    def close_slots(self) -> None:
        """Close every slot's evidence (reason ``closed``)."""
        for slot in list(self.slots.values()):
            slot.close()

    def __repr__(self) -> str:
        return f"<Connection {self.name!r} services={len(self.bindings)} slots={len(self.slots)}>"


class DiscoveryHandle:
    """Observe services through one named connection. Has no close rights."""

    __slots__ = ("_connection",)

    def __init__(self, connection: Connection) -> None:
        self._connection = connection

    @property
    def qualifier(self) -> str:
        """The connection's name."""
        return self._connection.name

    def services(self) -> tuple[str, ...]:
        """The service aliases bound on this connection."""
        return tuple(self._connection.bindings)

    async def observe(self, service: str, deadline: float | None = None) -> Observation:
        """The shared observation of ``service`` (an alias bound on this connection).

        ``deadline`` (absolute, event-loop clock) covers the cache hit and the
        wait for the first query; ``None`` (the default) means no deadline
        beyond the caller's cancel scope (``with anyio.fail_after(2):``).
        A deadline far in the past gets a hint in its error: deadlines are
        absolute (``anyio.current_time() + 2``), not durations. A deadline
        that is NaN or already past raises ``DeadlineExceeded`` before
        anything happens: no access time is recorded, no slot created, no
        query started. The deadline is checked again after waiting. A failed
        first query still returns the observation; its
        :meth:`~Observation.snapshot` says why nothing may be used. Raises
        ``UnknownService``, ``CapacityExceeded`` or ``LifecycleError``
        (owner not prepared, or closing).
        """
        return await self._connection.observe(service, deadline)

    def __repr__(self) -> str:
        return f"<DiscoveryHandle {self._connection.name!r}>"
