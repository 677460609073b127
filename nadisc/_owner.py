"""The discovery owner: one resource lifecycle for connections, observations
and registrations.

::

    OwnerBuilder ─open()─► BUILT ─prepare()─► PREPARING ─► PREPARED
                                                              │ freeze_registrations()
                                                              ▼
                                        PUBLISHED ◄─publish()─ FROZEN
                                            │
                 begin_quiesce() (any phase before CLOSING)
                                            ▼
                                        QUIESCING ─begin_close()─► CLOSING ─► CLOSED

``async with open_discovery(config) as owner`` builds, opens and prepares;
when the config carries ``registrations`` it also resolves them against the
host's bound ``listeners`` and local ``eligibility``, freezes the plan (every
check before any write) and publishes it, returning only once every
startup-required registration is confirmed Active. Leaving the block
quiesces (deregisters) and closes within the shutdown deadline and leaves
:attr:`DiscoveryOwner.close_report`. A standalone host drives the same stages
itself inside ``async with OwnerBuilder()...open() as owner``.

*Startup requirement.* A connection must prepare when its policy says
``startup_required`` **or** when a startup-required registration publishes
on it (a required registration raises its connection's requirement).

*Ownership.* Every task (observation refresh, watch, registration work) is a
child of the task group :meth:`OwnerBuilder.open` holds; nothing outlives the
``async with``. The owner cannot be copied or pickled. :class:`DiscoveryHandle`,
:class:`Observation` and :class:`RuntimeObserver` hold no close rights.

*Deadlines* are absolute times on the event-loop clock
(``anyio.current_time() + 5``). NaN or past deadlines raise
:class:`~nadisc.DeadlineExceeded` before anything happens. ``begin_quiesce``
and ``begin_close`` share the *first* shutdown deadline given; the waitable
they return may be dropped without cancelling the cleanup, which runs in the
owner's task group.

*Registration seam.* Registration writes are not implemented here. An owner
may be given a component (see :class:`RegistrationComponent`) that it calls
at the matching stages: ``freeze`` in :meth:`DiscoveryOwner.freeze_registrations`,
``publish`` in :meth:`DiscoveryOwner.publish`, ``begin_quiesce`` and ``drain`` during
shutdown, ``report`` for the :class:`CloseReport`.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ._capacity import SnapshotLedger, TaskBudget, WatchStreams
from ._config import (
    DEFAULT_QUALIFIER,
    ConnectionConfig,
    DiscoveryConfig,
    LimitsConfig,
    binding_names,
    validate_provider_block,
)
from ._connection import Connection, DiscoveryHandle
from ._eligibility import Eligibility
from ._errors import (
    ConfigError,
    DeadlineExceeded,
    LifecycleError,
    PrepareError,
    ProviderFailure,
    QualifierError,
    RegistrationError,
)
from ._observation import Slot, check_deadline, check_deadline_value
from ._probe import EligibilityProbe
from ._provider import ConnectionContext, Provider
from ._registration import (
    OwnerRegistrations,
    RegistrationSpec,
    RegistrationStatus,
    resolve_registrations,
)
from ._registry import load_factory

if TYPE_CHECKING:
    from ._grpc_calls import GrpcCallCounts
    from ._observer import RuntimeObserver
    from ._rest import RestDiscoveryClient
    from ._route import Route

__all__ = [
    "CloseReport",
    "ConnectionSpec",
    "DiscoveryOwner",
    "OwnerBuilder",
    "Phase",
    "RegistrationComponent",
    "ShutdownWaiter",
    "open_discovery",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The policy a standalone host gets when it gives none.
_HOST_PROVIDER = "host"


class Phase(enum.Enum):
    """The owner's lifecycle phase, in lifecycle order (values are metric-safe labels)."""

    BUILT = "built"
    PREPARING = "preparing"
    PREPARED = "prepared"
    FROZEN = "frozen"
    PUBLISHED = "published"
    QUIESCING = "quiescing"
    CLOSING = "closing"
    CLOSED = "closed"


_OBSERVABLE = frozenset({Phase.PREPARED, Phase.FROZEN, Phase.PUBLISHED, Phase.QUIESCING})


@dataclass(frozen=True, slots=True)
class CloseReport:
    """What the shutdown achieved. Check it: nothing here is guaranteed by dropping."""

    #: The shared shutdown deadline passed before cleanup finished.
    deadline_elapsed: bool
    #: Tasks of the owner still alive when the report was made (0 when clean).
    tasks_left: int
    #: Connections whose provider did not close cleanly within the deadline.
    provider_errors: tuple[str, ...] = ()
    #: The registration component's final report (empty without one).
    registrations: tuple[object, ...] = ()


@dataclass(frozen=True, slots=True)
class ConnectionSpec:
    """A connection for a standalone host: a provider object and its policy.

    ``services`` binds aliases to remote names; when omitted the bindings come
    from the policy's provider block, else from the provider's own
    ``bindings()`` (static and memory providers have one).
    """

    name: str
    provider: Provider
    policy: ConnectionConfig | None = None
    services: Mapping[str, str] | None = None


class RegistrationComponent(Protocol):
    """The seam a registration lifecycle plugs into (all calls from the owner)."""

    def freeze(self, specs: Sequence[object], connections: Mapping[str, Connection]) -> None:
        """Check and freeze the whole plan before any write (raise to refuse)."""

    async def publish(self, task_group: TaskGroup, deadline: float) -> None:
        """Write the registrations; long-running work goes into ``task_group``."""

    def begin_quiesce(self, deadline: float) -> None:
        """Synchronously stop new registrations and health publishing."""

    async def drain(self, deadline: float) -> None:
        """Deregister within ``deadline``."""

    def report(self) -> Sequence[object]:
        """Final per-registration outcomes for the close report."""

    # Optional parts, looked up by name:
    # * ``revoke_identity(qualifier)`` (synchronous): the owner calls it
    #   whenever an observation of that connection sees its identity or
    #   permission revoked;
    # * ``async identity_revoked(qualifier, *, after_epoch=None) -> int``:
    #   backs :meth:`DiscoveryOwner.identity_revoked`;
    # * ``statuses() -> Mapping[str, RegistrationStatus]``: backs
    #   :meth:`DiscoveryOwner.registrations` and the observer;
    # * ``use_operations(limiter)`` (synchronous): the owner hands over its
    #   ``max_parallel_operations`` limiter when it is created; every
    #   registry call of the registrations then waits for a turn under it.


class _Child:
    """One keyed child task of the owner (see :meth:`DiscoveryOwner.start_child`)."""

    __slots__ = ("error", "ready", "value")

    def __init__(self) -> None:
        self.ready = anyio.Event()
        self.value: object = None
        self.error: BaseException | None = None


class _StartedFlag:
    """Forwards ``started()`` and remembers that it was called."""

    __slots__ = ("done", "inner")

    def __init__(self, inner: TaskStatus[object]) -> None:
        self.inner = inner
        self.done = False

    def started(self, value: object = None) -> None:
        self.done = True
        self.inner.started(value)


class ShutdownWaiter(Generic[T]):
    """The waitable a shutdown stage returns. Dropping it cancels nothing."""

    __slots__ = ("_done", "_value")

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._value: T | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _finish(self, value: T) -> None:
        self._value = value
        self._done.set()

    async def wait(self) -> T:
        """Wait for the stage to finish (cancelling this wait cancels nothing else)."""
        await self._done.wait()
        return self._value  # type: ignore[return-value]


def _policy_for_host() -> ConnectionConfig:
    return ConnectionConfig(provider=_HOST_PROVIDER)


class _Given:
    """A provider handed to the builder ready-made: the owner takes it over
    at ``open()`` (and closes it, even when ``open()`` fails)."""

    __slots__ = ("provider",)

    def __init__(self, provider: Provider) -> None:
        self.provider = provider

    def __call__(self) -> Provider:
        return self.provider


def _constant(provider: Provider) -> Callable[[], Provider]:
    return _Given(provider)


def _provider_bindings(provider: object) -> Mapping[str, str]:
    bindings = getattr(provider, "bindings", None)
    if callable(bindings):
        result = bindings()
        if isinstance(result, Mapping):
            return {str(k): str(v) for k, v in result.items()}
    return {}


class _Runtime:
    """The owner internals connections and slots use (not public)."""

    def __init__(self, owner: DiscoveryOwner, limits: LimitsConfig) -> None:
        self._owner = owner
        self.ledger = SnapshotLedger(
            max_instances_per_service=limits.max_instances_per_service,
            max_total_instances=limits.max_total_instances,
            max_snapshot_bytes=limits.max_snapshot_bytes,
        )
        self.streams = WatchStreams(limits.max_watch_streams)
        self.tasks = TaskBudget(limits.max_transport_tasks)
        self.live_tasks = 0
        self.max_service_watches = limits.max_service_watches_per_connection

    def check_observable(self) -> None:
        self._owner._check_observable()

    def identity_revoked(self, connection: str) -> None:
        self._owner._identity_revoked(connection)

    async def start_slot(self, slot: Slot) -> None:
        work = self._owner._work
        if work is None:
            raise LifecycleError("the owner is not running")
        await work.start(slot.run)


class DiscoveryOwner:
    """Owns named connections, shared observations and the shutdown.

    Not copyable, not picklable: exactly one object holds close rights.
    Create it with :func:`open_discovery` or :meth:`OwnerBuilder.open`.
    """

    def __init__(
        self,
        *,
        connections: Mapping[str, tuple[Provider, ConnectionConfig, Mapping[str, str]]],
        limits: LimitsConfig,
        default_connection: str | None,
        shutdown_timeout: float,
        registrations: RegistrationComponent | None,
        planned: Sequence[object] = (),
        eligibility_probe: bool = False,
    ) -> None:
        self._phase = Phase.BUILT
        self._limits = limits
        self._eligibility_probe = bool(eligibility_probe)
        self._runtime = _Runtime(self, limits)
        self._connections: dict[str, Connection] = {
            name: Connection(name, provider, policy, bindings, self._runtime)
            for name, (provider, policy, bindings) in connections.items()
        }
        self._default = default_connection
        self._shutdown_timeout = shutdown_timeout
        self._registrations = registrations
        #: The registration plan given before prepare (config or builder).
        self._planned: tuple[object, ...] = tuple(planned)
        #: connection -> startup-required registrations publishing on it.
        self._required_by: dict[str, list[str]] = {}
        for spec in self._planned:
            if isinstance(spec, RegistrationSpec) and spec.startup_required:
                self._required_by.setdefault(spec.qualifier, []).append(spec.name)
        self._tg: TaskGroup | None = None
        self._work: TaskGroup | None = None
        self._work_done = anyio.Event()
        self._shutdown_deadline: float | None = None
        self._quiesce_waiter: ShutdownWaiter[None] | None = None
        self._close_waiter: ShutdownWaiter[CloseReport] | None = None
        self._close_report: CloseReport | None = None
        self._prepared = False
        #: Concurrency bound for one-shot control operations (max_parallel_operations):
        #: preparation and every registry call of the registrations (first
        #: writes, renewals, checks, deregistrations), served in arrival order.
        self.operations = anyio.CapacityLimiter(limits.max_parallel_operations)
        use_operations = getattr(registrations, "use_operations", None)
        if callable(use_operations):
            use_operations(self.operations)
        #: Keyed child tasks started by :meth:`start_child`.
        self._children: dict[tuple[str, Hashable], _Child] = {}
        #: REST callers handed out by rest(), closed by the owner's close.
        self._rest: dict[str | None, RestDiscoveryClient] = {}
        #: connection name -> its gRPC discovery channels' call counts (kept
        #: after the channels close, so exported counters never go backwards).
        self._grpc_calls: dict[str, GrpcCallCounts] = {}
        #: The routes of the gRPC discovery channels open now (the observer
        #: lists them with the REST callers' routes), in opening order.
        self._grpc_routes: dict[Route, None] = {}

    # ------------------------------------------------------------------ no copies

    def __copy__(self) -> DiscoveryOwner:
        raise TypeError("DiscoveryOwner cannot be copied: it is the only holder of close rights")

    def __deepcopy__(self, memo: object) -> DiscoveryOwner:
        raise TypeError("DiscoveryOwner cannot be copied: it is the only holder of close rights")

    def __reduce_ex__(self, protocol: object) -> str:
        raise TypeError("DiscoveryOwner cannot be pickled")

    def __getstate__(self) -> object:
        raise TypeError("DiscoveryOwner cannot be pickled")

    # ------------------------------------------------------------------ facts

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def prepared(self) -> bool:
        """Initial preparation passed (says nothing about instances' health)."""
        return self._prepared

    @property
    def close_report(self) -> CloseReport | None:
        """The report of the finished close (None before)."""
        return self._close_report

    @property
    def limits(self) -> LimitsConfig:
        return self._limits

    def connection_names(self) -> tuple[str, ...]:
        return tuple(self._connections)

    def observer(self) -> RuntimeObserver:
        """A read-only view for metrics and diagnosis (no close rights)."""
        from ._observer import RuntimeObserver

        return RuntimeObserver(self)

    async def start_child(
        self,
        qualifier: str | None,
        key: Hashable,
        fn: Callable[..., Awaitable[object]],
    ) -> object:
        """Run ``fn(provider, task_status=...)`` once per (connection, ``key``)
        as a child of the owner's task group; return what it passed to
        ``task_status.started()``.

        This is how a provider package adds long-running work to one
        connection (a catalog worker, say) without owning a task itself.
        ``provider`` is the connection's provider. A second call with the
        same connection and key starts nothing: it returns the first call's
        value (waiting for that start to finish if needed). If ``fn`` fails
        before it started, the starting caller gets its error, waiting
        callers a :class:`~nadisc.LifecycleError` chained to it, and the key
        is free again; a failure after the start is logged, frees the key and
        leaves the owner running. The child is cancelled when the owner
        closes, like every other task of the owner.

        Raises ``QualifierError`` for an unknown connection and
        ``LifecycleError`` once quiesce began (or before the owner runs).
        """
        connection = self._resolve(qualifier)
        if self._phase in (Phase.QUIESCING, Phase.CLOSING, Phase.CLOSED):
            raise LifecycleError(f"the owner is {self._phase.name.lower()}: no new child tasks")
        work = self._work
        if work is None:
            raise LifecycleError("the owner is not running")
        slot = (connection.name, key)
        child = self._children.get(slot)
        if child is not None:
            await child.ready.wait()
            if child.error is not None:
                raise LifecycleError(
                    f"connection {connection.name!r}: child {key!r} failed to start"
                ) from child.error
            return child.value
        child = self._children[slot] = _Child()
        try:
            child.value = await work.start(self._run_child, slot, child, fn, connection.provider)
        except BaseException as exc:
            child.error = exc
            if self._children.get(slot) is child:
                del self._children[slot]
            raise
        finally:
            child.ready.set()
        return child.value

    async def _run_child(
        self,
        slot: tuple[str, Hashable],
        child: _Child,
        fn: Callable[..., Awaitable[object]],
        provider: Provider,
        *,
        task_status: TaskStatus[object],
    ) -> None:
        flag = _StartedFlag(task_status)
        self._runtime.live_tasks += 1
        try:
            await fn(provider, task_status=flag)
        except Exception:
            if not flag.done:
                raise
            logger.exception("connection %r: child %r failed", slot[0], slot[1])
        finally:
            self._runtime.live_tasks -= 1
            if flag.done and self._children.get(slot) is child:
                del self._children[slot]

    def __repr__(self) -> str:
        slots = sum(len(c.slots) for c in self._connections.values())
        return (
            f"<DiscoveryOwner phase={self._phase.name} connections={len(self._connections)} "
            f"observations={slots} tasks={self._runtime.live_tasks}>"
        )

    # ------------------------------------------------------------------ selection

    def _resolve(self, qualifier: str | None) -> Connection:
        if not self._connections:
            raise QualifierError("no connections are configured: internal lookups are refused")
        if qualifier is None:
            name = self._default if self._default is not None else DEFAULT_QUALIFIER
            connection = self._connections.get(name)
            if connection is None:
                raise QualifierError(
                    f"no default connection: none is named {DEFAULT_QUALIFIER!r}; select one "
                    f"explicitly (configured: {', '.join(sorted(self._connections))})"
                )
            return connection
        if not isinstance(qualifier, str):
            raise QualifierError(
                f"a qualifier is a connection name, not {type(qualifier).__name__}"
            )
        connection = self._connections.get(qualifier)
        if connection is None:
            raise QualifierError(
                f"unknown connection {qualifier!r} "
                f"(configured: {', '.join(sorted(self._connections))})"
            )
        return connection

    def connection_policy(self, qualifier: str | None = None) -> ConnectionConfig:
        """The frozen settings of the named connection (``None``: the default).

        Read-only facts for callers built on the owner (the ``rest`` block,
        timeouts). Raises ``QualifierError`` like :meth:`client`.
        """
        return self._resolve(qualifier).policy

    def grpc_call_counts(self, qualifier: str | None = None) -> GrpcCallCounts:
        """The call counts the gRPC discovery channels of connection ``qualifier`` add to.

        Created on first use and kept for the owner's life (the observer
        reads them). Raises ``QualifierError`` like :meth:`client`.
        """
        name = self._resolve(qualifier).name
        counts = self._grpc_calls.get(name)
        if counts is None:
            from ._grpc_calls import GrpcCallCounts

            counts = self._grpc_calls[name] = GrpcCallCounts()
        return counts

    def rest(self, qualifier: str | None = None) -> RestDiscoveryClient:
        """The owner's REST caller of connection ``qualifier`` (``None``: ``primary``).

        Created on first use with that connection's ``rest`` options and
        shared afterwards; the owner closes it (and its managed responses)
        when it closes. With zero connections it is external-only. Raises
        ``QualifierError`` for an unknown name and ``LifecycleError`` once
        the owner is closing.
        """
        from ._rest import RestDiscoveryClient

        if self._phase in (Phase.CLOSING, Phase.CLOSED):
            raise LifecycleError(f"the owner is {self._phase.name.lower()}: no new REST callers")
        client = self._rest.get(qualifier)
        if client is None or client.closed:
            client = self._rest[qualifier] = RestDiscoveryClient(self, qualifier)
        return client

    def client(self, qualifier: str | None = None) -> DiscoveryHandle:
        """A handle on the named connection (``None``: the default, ``primary``).

        The default is the fixed name ``primary`` (case-sensitive), or the
        legacy ``default_connection`` when one was set; it is never inferred
        from how many connections there are or their order.
        """
        connection = self._resolve(qualifier)
        self._check_observable()
        return DiscoveryHandle(connection)

    def registrations(self) -> Mapping[str, RegistrationStatus]:
        """Immutable per-registration status now, judged under each
        connection's current identity epoch (empty without a registration
        component or before the plan was frozen)."""
        statuses = getattr(self._registrations, "statuses", None)
        if callable(statuses):
            result = statuses()
            if isinstance(result, Mapping):
                return result
        return MappingProxyType({})

    def eligibility_probe(self) -> EligibilityProbe:
        """The ASGI app answering ``GET /discovery/eligible/{registration}``.

        The host mounts or serves it (see ``docs/registration.md``). It is
        enabled only when the config's ``eligibility_probe`` is true (or the
        builder enabled it); otherwise every path answers 404. Keyed by
        registration name, it reads a live view of each registration's local
        eligibility only (never the registration's own state or overall
        readiness, so no cycle); it knows the registrations once the plan is
        frozen, and nothing without a registration component.
        """
        source = getattr(self._registrations, "eligibilities", None)
        mapping: Mapping[str, Eligibility] = MappingProxyType({})
        if callable(source):
            found = source()
            if isinstance(found, Mapping):
                mapping = found
        return EligibilityProbe(mapping, enabled=self._eligibility_probe)

    async def identity_revoked(self, qualifier: str, *, after_epoch: int | None = None) -> int:
        """Wait until the identity of connection ``qualifier`` is revoked
        (its epoch exceeds ``after_epoch``, default: the current one) and
        return the new epoch. Revocations come from observations of the
        connection and from its registry calls; either cancels the health
        evidence of that connection's registrations only.

        Raises ``QualifierError`` for an unknown connection and
        ``LifecycleError`` when the owner has no registration component that
        tracks identities.
        """
        connection = self._resolve(qualifier)
        wait = getattr(self._registrations, "identity_revoked", None)
        if not callable(wait):
            raise LifecycleError("the owner has no registration component tracking identities")
        epoch = await wait(connection.name, after_epoch=after_epoch)
        return int(epoch)

    def _identity_revoked(self, connection: str) -> None:
        """Tell the registration component (if it listens) that a connection's
        identity was revoked: its registrations lose their health evidence;
        other connections are untouched."""
        logger.warning("connection %r: identity or permission revoked", connection)
        revoke = getattr(self._registrations, "revoke_identity", None)
        if callable(revoke):
            try:
                revoke(connection)
            except Exception:
                logger.exception("the registration component failed to take a revocation")

    def _check_observable(self) -> None:
        if self._phase not in _OBSERVABLE:
            if self._phase in (Phase.BUILT, Phase.PREPARING):
                raise LifecycleError("the owner is not prepared yet")
            raise LifecycleError(f"the owner is {self._phase.name.lower()}")

    # ------------------------------------------------------------------ stages

    async def prepare(self, deadline: float) -> None:
        """Bring the connections up. Startup-required ones must succeed.

        Raises :class:`~nadisc.PrepareError` naming the first (by name)
        required connection that failed; the owner stays ``BUILT`` then.
        """
        check_deadline(deadline, anyio.current_time())
        if self._phase is not Phase.BUILT:
            raise LifecycleError(f"prepare needs phase BUILT, the owner is {self._phase.name}")
        self._phase = Phase.PREPARING
        try:
            async with anyio.create_task_group() as tg:
                for connection in self._connections.values():
                    tg.start_soon(self._prepare_one, connection, deadline)
        except BaseException:
            if self._phase is Phase.PREPARING:
                self._phase = Phase.BUILT
            raise
        failed = [
            c
            for name, c in sorted(self._connections.items())
            if c.prepared is False and self._startup_required(c)
        ]
        if self._phase is not Phase.PREPARING:
            raise LifecycleError(f"the owner moved to {self._phase.name} while preparing")
        if failed:
            self._phase = Phase.BUILT
            first = failed[0]
            message = first.prepare_error or "failed"
            raised_by = self._required_by.get(first.name)
            if raised_by and not first.policy.startup_required:
                message += (
                    " (required because startup-required registration(s) "
                    + ", ".join(repr(n) for n in raised_by)
                    + " publish on it)"
                )
            if len(failed) > 1:
                message += "; also failed: " + ", ".join(repr(c.name) for c in failed[1:])
            raise PrepareError(first.name, message)
        for connection in self._connections.values():
            if connection.prepared is False:
                logger.warning(
                    "connection %r is not startup-required and failed to prepare: %s",
                    connection.name,
                    connection.prepare_error,
                )
        self._prepared = True
        self._phase = Phase.PREPARED

    def _startup_required(self, connection: Connection) -> bool:
        """The policy's requirement, raised by required registrations on it."""
        return connection.policy.startup_required or connection.name in self._required_by

    async def _prepare_one(self, connection: Connection, deadline: float) -> None:
        limit = min(deadline, anyio.current_time() + connection.request_timeout)
        error: str | None = None
        kind: str | None = None
        with anyio.move_on_at(limit) as scope:
            async with self.operations:
                try:
                    await connection.provider.prepare(limit)
                except ProviderFailure as exc:
                    kind = type(exc).__name__
                    error = f"{kind}: {exc}"
                except Exception as exc:
                    logger.warning(
                        "connection %r: provider prepare raised %s",
                        connection.name,
                        type(exc).__name__,
                    )
                    kind = "ProviderRaised"
                    error = f"the provider raised {type(exc).__name__}"
        if scope.cancelled_caught:
            kind = "DeadlineExceeded"
            error = "the deadline passed while preparing"
        connection.prepared = error is None
        # Shown by the observer, the console, ``watch`` and PrepareError: the
        # connection's own secrets and any credential-looking value are cut out.
        connection.prepare_error = None if error is None else connection.redacted(error)
        connection.prepare_error_kind = kind

    def freeze_registrations(self, specs: Sequence[object] | None = None) -> None:
        """Freeze the registration plan (checked whole, before any write).

        ``specs=None`` freezes the plan the owner was built with (from the
        config's ``registrations`` or :meth:`OwnerBuilder.registration_plan`;
        empty without one). Explicit specs are refused when such a plan
        exists (``LifecycleError``): one plan per owner. A startup-required
        registration whose connection failed to prepare raises
        :class:`~nadisc.PrepareError` naming the connection: the registration
        raised that connection's startup requirement.
        """
        if self._phase is not Phase.PREPARED:
            raise LifecycleError(
                f"freeze_registrations needs phase PREPARED, the owner is {self._phase.name}"
            )
        if specs is None:
            plan = self._planned
        elif self._planned:
            raise LifecycleError(
                "the owner already has a registration plan (from the config or the builder): "
                "call freeze_registrations() without specs"
            )
        else:
            plan = tuple(specs)
        for spec in plan:
            if not (isinstance(spec, RegistrationSpec) and spec.startup_required):
                continue
            connection = self._connections.get(spec.qualifier)
            if connection is not None and connection.prepared is False:
                raise PrepareError(
                    connection.name,
                    f"startup-required registration {spec.name!r} publishes on it, but it "
                    f"failed to prepare: {connection.prepare_error or 'failed'}",
                )
        if self._registrations is None:
            if plan:
                raise LifecycleError(
                    "registrations were given but the owner has no registration component"
                )
        else:
            self._registrations.freeze(plan, dict(self._connections))
        self._phase = Phase.FROZEN

    async def publish(self, deadline: float) -> None:
        """Publish the frozen registrations (a no-op without any)."""
        check_deadline(deadline, anyio.current_time())
        if self._phase is not Phase.FROZEN:
            raise LifecycleError(f"publish needs phase FROZEN, the owner is {self._phase.name}")
        if self._registrations is not None:
            work = self._work
            if work is None:
                raise LifecycleError("the owner is not running")
            await self._registrations.publish(work, deadline)
        if self._phase is Phase.FROZEN:
            self._phase = Phase.PUBLISHED

    def _first_deadline(self, deadline: float) -> float:
        if self._shutdown_deadline is None:
            check_deadline(deadline, anyio.current_time())
            self._shutdown_deadline = deadline
        return self._shutdown_deadline

    def begin_quiesce(self, deadline: float) -> ShutdownWaiter[None]:
        """Stop new registrations and health publishing now; keep discovery.

        Returns a waitable that finishes when the registrations drained.
        Every ``deadline`` must be a number (not NaN); the first one given to
        either stage must lie ahead and is shared by both, later ones are
        ignored (``DeadlineExceeded`` otherwise).
        """
        check_deadline_value(deadline)
        if self._quiesce_waiter is not None:
            return self._quiesce_waiter
        waiter: ShutdownWaiter[None] = ShutdownWaiter()
        if self._phase in (Phase.CLOSING, Phase.CLOSED) or self._tg is None:
            waiter._finish(None)
            self._quiesce_waiter = waiter
            return waiter
        shared = self._first_deadline(deadline)
        self._quiesce_waiter = waiter
        self._phase = Phase.QUIESCING
        if self._registrations is not None:
            self._registrations.begin_quiesce(shared)
        self._tg.start_soon(self._quiesce, shared, waiter)
        return waiter

    async def _quiesce(self, deadline: float, waiter: ShutdownWaiter[None]) -> None:
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_at(deadline):
                if self._registrations is not None:
                    try:
                        await self._registrations.drain(deadline)
                    except Exception:
                        logger.exception("draining registrations failed")
        finally:
            waiter._finish(None)

    def begin_close(self, deadline: float) -> ShutdownWaiter[CloseReport]:
        """Close outbound discovery and reclaim every task.

        Observations answer ``closed`` from now on. The waitable yields the
        :class:`CloseReport`; dropping it does not cancel the cleanup.
        ``deadline`` is checked as for :meth:`begin_quiesce`.
        """
        check_deadline_value(deadline)
        if self._close_waiter is not None:
            return self._close_waiter
        shared = self._first_deadline(deadline)
        waiter: ShutdownWaiter[CloseReport] = ShutdownWaiter()
        self._close_waiter = waiter
        self._phase = Phase.CLOSING
        for connection in self._connections.values():
            connection.close_slots()
        if self._tg is None:
            # Never opened: nothing runs; just finish.
            report = CloseReport(deadline_elapsed=False, tasks_left=0)
            self._close_report = report
            self._phase = Phase.CLOSED
            waiter._finish(report)
        else:
            self._tg.start_soon(self._close, shared, waiter)
        return waiter

    async def _close(self, deadline: float, waiter: ShutdownWaiter[CloseReport]) -> None:
        provider_errors: list[str] = []
        closed: list[str] = []
        elapsed = False
        try:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_at(deadline) as scope:
                    for rest in list(self._rest.values()):
                        try:
                            await rest.aclose()
                        except Exception:
                            logger.exception("closing a REST caller failed")
                    if self._quiesce_waiter is not None:
                        await self._quiesce_waiter.wait()
                    elif self._registrations is not None:
                        self._registrations.begin_quiesce(deadline)
                        try:
                            await self._registrations.drain(deadline)
                        except Exception:
                            logger.exception("draining registrations failed")
                    if self._work is not None:
                        self._work.cancel_scope.cancel()
                        await self._work_done.wait()
                    async with anyio.create_task_group() as tg:
                        for connection in self._connections.values():
                            tg.start_soon(self._close_provider, connection, closed, provider_errors)
                elapsed = scope.cancelled_caught
                if self._work is not None and not self._work_done.is_set():
                    # Past the deadline: stop waiting, but cancel everything.
                    self._work.cancel_scope.cancel()
                if elapsed:
                    # Providers still closing when the budget ran out.
                    provider_errors.extend(n for n in self._connections if n not in closed)
        finally:
            registrations: tuple[object, ...] = ()
            if self._registrations is not None:
                try:
                    registrations = tuple(self._registrations.report())
                except Exception:
                    logger.exception("the registration report failed")
            report = CloseReport(
                deadline_elapsed=elapsed,
                tasks_left=self._runtime.live_tasks,
                provider_errors=tuple(sorted(set(provider_errors))),
                registrations=registrations,
            )
            self._close_report = report
            self._phase = Phase.CLOSED
            waiter._finish(report)

    async def _close_provider(
        self, connection: Connection, closed: list[str], errors: list[str]
    ) -> None:
        try:
            await connection.provider.aclose()
        except Exception as exc:
            logger.warning(
                "connection %r: provider close raised %s", connection.name, type(exc).__name__
            )
            errors.append(connection.name)
        else:
            closed.append(connection.name)

    # ------------------------------------------------------------------ running

    async def _run_work(self, *, task_status: TaskStatus[None]) -> None:
        try:
            async with anyio.create_task_group() as work:
                self._work = work
                for connection in self._connections.values():
                    serve = getattr(connection.provider, "serve", None)
                    if callable(serve):
                        work.start_soon(self._serve_provider, connection.name, serve)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._work_done.set()

    async def _serve_provider(self, name: str, serve: Callable[[], Awaitable[object]]) -> None:
        """A provider's optional ``serve()`` (see :class:`~nadisc.Provider`):
        from the start of the owner until its close cancels the work, after the
        registrations were drained and before the provider is closed."""
        try:
            await serve()
        except Exception as exc:
            logger.warning("connection %r: provider serve raised %s", name, type(exc).__name__)

    async def _shutdown_on_exit(self) -> None:
        """Run (or finish) quiesce and close with the owner's shutdown budget."""
        if self._phase is Phase.CLOSED:
            return
        deadline = self._shutdown_deadline
        if deadline is None:
            deadline = anyio.current_time() + self._shutdown_timeout
        if self._phase not in (Phase.QUIESCING, Phase.CLOSING):
            self.begin_quiesce(deadline)
        await self.begin_close(deadline).wait()


class OwnerBuilder:
    """Collects connections for an owner; :meth:`open` runs it.

    ::

        builder = OwnerBuilder().connection(ConnectionSpec("business", provider))
        async with builder.open() as owner:
            await owner.prepare(anyio.current_time() + 5)
            owner.freeze_registrations([])
            await owner.publish(anyio.current_time() + 5)
            ...
    """

    def __init__(
        self,
        *,
        limits: LimitsConfig | None = None,
        shutdown_timeout: float = 10.0,
    ) -> None:
        if not (math.isfinite(shutdown_timeout) and shutdown_timeout > 0):
            raise ConfigError("shutdown_timeout", "must be a finite number of seconds > 0")
        self._limits = limits if limits is not None else LimitsConfig()
        self._shutdown_timeout = shutdown_timeout
        self._connections: dict[
            str, tuple[Callable[[], Provider], ConnectionConfig, Mapping[str, str] | None]
        ] = {}
        self._default: str | None = None
        self._registrations: RegistrationComponent | None = None
        self._planned: tuple[RegistrationSpec, ...] = ()
        self._eligibility_probe = False

    def connection(self, spec: ConnectionSpec) -> OwnerBuilder:
        """Add a connection with a ready provider object."""
        provider = spec.provider
        services = spec.services
        if services is None and spec.policy is not None:
            # The policy's provider block may bind the aliases.
            services = dict(binding_names(spec.policy)) or None
        self._add(spec.name, _constant(provider), spec.policy, services)
        return self

    def _add(
        self,
        name: str,
        make: Callable[[], Provider],
        policy: ConnectionConfig | None,
        services: Mapping[str, str] | None,
    ) -> None:
        path = f"connections.{name}"
        if not isinstance(name, str) or not name or name != name.strip():
            raise ConfigError("connections", f"invalid connection name {name!r}")
        if name in self._connections:
            raise ConfigError(path, "duplicate connection name")
        if len(self._connections) >= self._limits.max_connections:
            raise ConfigError(
                path, f"more than limits.max_connections ({self._limits.max_connections})"
            )
        self._connections[name] = (
            make,
            policy if policy is not None else _policy_for_host(),
            None if services is None else dict(services),
        )

    def default_connection(self, name: str) -> OwnerBuilder:
        """Legacy: the connection unqualified selection uses (wins over ``primary``)."""
        self._default = name
        return self

    def enable_eligibility_probe(self, enabled: bool = True) -> OwnerBuilder:
        """Serve ``owner.eligibility_probe()`` (config ``eligibility_probe``)."""
        self._eligibility_probe = bool(enabled)
        return self

    def registrations(self, component: RegistrationComponent) -> OwnerBuilder:
        """Plug in the registration lifecycle."""
        self._registrations = component
        return self

    def registration_plan(
        self,
        specs: Sequence[RegistrationSpec],
        *,
        listeners: Mapping[str, tuple[str, int]] | None = None,
        eligibility: Mapping[str, Eligibility] | None = None,
    ) -> OwnerBuilder:
        """Give the owner its registration plan up front.

        The owner then knows, before ``prepare``, which connections carry
        startup-required registrations (their preparation becomes required),
        and ``owner.freeze_registrations()`` without arguments freezes this
        plan. Without a component plugged in yet, an
        :class:`~nadisc.OwnerRegistrations` is created with ``listeners`` and
        ``eligibility`` (used for references the specs left unresolved).
        """
        checked: list[RegistrationSpec] = []
        for spec in specs:
            if not isinstance(spec, RegistrationSpec):
                raise RegistrationError(
                    "?", f"expected a RegistrationSpec, got {type(spec).__name__}"
                )
            checked.append(spec)
        if self._registrations is None:
            self._registrations = OwnerRegistrations(listeners=listeners, eligibility=eligibility)
        self._planned = tuple(checked)
        return self

    @classmethod
    def from_config(
        cls,
        config: DiscoveryConfig,
        *,
        providers: Mapping[str, Provider] | None = None,
        listeners: Mapping[str, tuple[str, int]] | None = None,
        eligibility: Mapping[str, Eligibility] | None = None,
        allow_loopback: bool = False,
    ) -> OwnerBuilder:
        """A builder for ``config``. Provider factories are looked up now
        (``ProviderNotFound`` names the config path); ``providers`` injects
        ready provider objects by connection name instead (tests, hosts).

        When the config has ``registrations``, they are resolved now against
        the bound ``listeners`` (name -> advertised ``(ip, port)``) and the
        local ``eligibility`` sources (name -> :class:`~nadisc.Eligibility`)
        and become the builder's :meth:`registration_plan`. A reference that
        cannot be resolved raises :class:`~nadisc.RegistrationError` naming
        its path (``discovery.registrations.<name>.eligibility_ref``) before
        anything is created. ``allow_loopback`` lets loopback addresses
        through (local development only).
        """
        injected = dict(providers or {})
        for name in injected:
            if name not in config.connections:
                raise ConfigError(f"providers.{name}", "no such connection in the config")
        builder = cls(limits=config.limits, shutdown_timeout=config.shutdown_timeout_ms / 1000.0)
        if config.default_connection is not None:
            builder.default_connection(config.default_connection)
        builder.enable_eligibility_probe(config.eligibility_probe)
        for name, connection in config.connections.items():
            services = dict(binding_names(connection))
            if name in injected:
                builder._add(name, _constant(injected[name]), connection, services or None)
                continue
            path = f"discovery.connections.{name}.provider"
            factory = load_factory(connection.provider, path=path)
            settings = validate_provider_block(name, connection, factory.settings_model)
            context = ConnectionContext(
                name=name,
                request_timeout=connection.request_timeout_ms / 1000.0,
                max_instances_per_service=config.limits.max_instances_per_service,
                max_response_bytes=config.limits.max_snapshot_bytes,
            )
            builder._add(name, partial(factory.create, context, settings), connection, services)
        if config.registrations:
            specs = resolve_registrations(
                config, listeners or {}, eligibility or {}, allow_loopback=allow_loopback
            )
            builder.registration_plan(specs, listeners=listeners, eligibility=eligibility)
        return builder

    @asynccontextmanager
    async def open(self) -> AsyncIterator[DiscoveryOwner]:
        """Run an owner (phase ``BUILT``) for the block; close it on the way out.

        Checks that need no provider (the legacy default connection) run
        first, then providers are created; on any refusal or failure no
        factory runs after it, the providers already created and every
        ready-made provider handed over (``ConnectionSpec``) are closed, and
        nothing runs. Leaving the block runs quiesce
        and close (if the host did not) within the first shutdown deadline
        given, or the builder's ``shutdown_timeout`` from now.
        """
        created: dict[str, tuple[Provider, ConnectionConfig, Mapping[str, str]]] = {}
        try:
            # Everything that can be checked without a provider is checked
            # before the first one is created: a refusal creates nothing.
            if self._default is not None and self._default not in self._connections:
                raise ConfigError("default_connection", f"unknown connection {self._default!r}")
            for name, (make, policy, services) in self._connections.items():
                provider = make()
                bindings = services if services else _provider_bindings(provider)
                created[name] = (provider, policy, bindings)
            owner = DiscoveryOwner(
                connections=created,
                limits=self._limits,
                default_connection=self._default,
                shutdown_timeout=self._shutdown_timeout,
                registrations=self._registrations,
                planned=self._planned,
                eligibility_probe=self._eligibility_probe,
            )
        except BaseException:
            # Close what was created, and every ready-made provider handed
            # over (created or not yet): nothing is left half-built.
            doomed = {id(p): p for p, _, _ in created.values()}
            for make, _, _ in self._connections.values():
                if isinstance(make, _Given):
                    doomed.setdefault(id(make.provider), make.provider)
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._shutdown_timeout):
                for provider in doomed.values():
                    try:
                        await provider.aclose()
                    except Exception:
                        logger.exception("closing a provider after a failed build")
            raise
        try:
            async with anyio.create_task_group() as tg:
                owner._tg = tg
                try:
                    # Inside the cleanup: a cancellation that lands while the
                    # work group starts (an already-cancelled scope, a
                    # deadline that fired during provider construction) still
                    # closes the providers and leaves a close report.
                    await tg.start(owner._run_work)
                    yield owner
                finally:
                    with anyio.CancelScope(shield=True):
                        await owner._shutdown_on_exit()
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The owner's own tasks never fail, so a group holds what the
            # block raised: hand that exception back unwrapped.
            if len(group.exceptions) != 1:
                raise
            inner = group.exceptions[0]
            context = inner.__context__
            try:
                raise inner
            finally:
                inner.__context__ = context


@asynccontextmanager
async def open_discovery(
    config: DiscoveryConfig,
    *,
    providers: Mapping[str, Provider] | None = None,
    prepare_deadline: float | None = None,
    listeners: Mapping[str, tuple[str, int]] | None = None,
    eligibility: Mapping[str, Eligibility] | None = None,
    publish_deadline: float | None = None,
    allow_loopback: bool = False,
) -> AsyncIterator[DiscoveryOwner]:
    """Build, run and prepare an owner for ``config``; close it on the way out.

    The host flow: bind the listeners first, then::

        async with open_discovery(config, listeners={"web": ("10.0.0.5", 8080)},
                                  eligibility={"web": web}) as owner:
            ...   # every startup-required registration is Active here

    With ``config.registrations``, the plan is resolved against ``listeners``
    and ``eligibility`` before anything runs (a missing reference raises
    :class:`~nadisc.RegistrationError` naming its path), connections carrying
    a startup-required registration must prepare, the plan is frozen (all
    checks before any write) and published; entry returns once every
    startup-required registration is Active. Otherwise entry raises
    ``RegistrationError`` naming the registration that failed for good, or
    ``DeadlineExceeded`` naming those still unconfirmed at
    ``publish_deadline`` — after deregistering what was written and closing
    everything (the exception carries a note with each registration's close
    outcome).

    ``prepare_deadline`` defaults to now plus the longest connection
    ``request_timeout_ms``; ``publish_deadline`` to the end of preparation
    plus the longest ``observation_grace_ms`` of a connection carrying a
    registration. Raises ``ProviderNotFound``/``ConfigError`` before anything
    runs, ``PrepareError`` when a startup-required connection could not come
    up (after closing what was opened). On exit the owner is quiesced
    (registrations deregistered) and closed within ``shutdown_timeout_ms``
    (or the first shutdown deadline the body gave) and
    ``owner.close_report`` is set, its ``registrations`` holding each
    registration's final outcome.
    """
    async with _open_discovery(
        config,
        providers=providers,
        prepare_deadline=prepare_deadline,
        listeners=listeners,
        eligibility=eligibility,
        publish_deadline=publish_deadline,
        allow_loopback=allow_loopback,
    ) as owner:
        yield owner


class StartupHooks(Protocol):
    """How a host follows the start of :func:`_open_discovery` and may cut it
    short (``nadisc.hosting`` does, for a SIGTERM during startup)."""

    def startup_began(self, scope: anyio.CancelScope) -> None:
        """Preparing starts inside ``scope``; cancelling it ends the start
        early (the owner is yielded all the same)."""

    def startup_publishing(self) -> None:
        """The registrations are about to be written."""

    def startup_ended(self, interrupted: bool) -> None:
        """The start is over (``interrupted``: the scope cut it short)."""


@asynccontextmanager
async def _open_discovery(
    config: DiscoveryConfig,
    *,
    providers: Mapping[str, Provider] | None = None,
    prepare_deadline: float | None = None,
    listeners: Mapping[str, tuple[str, int]] | None = None,
    eligibility: Mapping[str, Eligibility] | None = None,
    publish_deadline: float | None = None,
    allow_loopback: bool = False,
    hooks: StartupHooks | None = None,
) -> AsyncIterator[DiscoveryOwner]:
    """:func:`open_discovery`; with ``hooks``, a start that may be cut short."""
    for label, value in (("prepare", prepare_deadline), ("publish", publish_deadline)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value)
        ):
            raise DeadlineExceeded(f"{label} deadline is not a number: {value!r}")
    builder = OwnerBuilder.from_config(
        config,
        providers=providers,
        listeners=listeners,
        eligibility=eligibility,
        allow_loopback=allow_loopback,
    )
    if prepare_deadline is None:
        longest = max((c.request_timeout_ms for c in config.connections.values()), default=1000)
        prepare_deadline = anyio.current_time() + longest / 1000.0
    opened: DiscoveryOwner | None = None
    started = False
    try:
        async with builder.open() as owner:
            opened = owner
            startup = anyio.CancelScope()
            try:
                with startup:
                    if hooks is not None:
                        hooks.startup_began(startup)
                    await owner.prepare(prepare_deadline)
                    if builder._planned:
                        owner.freeze_registrations()
                        if publish_deadline is None:
                            carrying = {spec.qualifier for spec in builder._planned}
                            grace = max(
                                (
                                    config.connections[q].observation_grace_ms
                                    for q in carrying
                                    if q in config.connections
                                ),
                                default=15_000,
                            )
                            publish_deadline = anyio.current_time() + grace / 1000.0
                        if hooks is not None:
                            hooks.startup_publishing()
                        await owner.publish(publish_deadline)
            finally:
                if hooks is not None:
                    hooks.startup_ended(startup.cancelled_caught)
            started = True
            yield owner
    except (RegistrationError, DeadlineExceeded) as exc:
        report = opened.close_report if opened is not None else None
        if not started and report is not None and report.registrations:
            exc.add_note(_close_note(report.registrations))
        raise


#: Registrations a start-up failure's note names one by one; the rest are counted.
_NOTE_NAMED = 20


def _close_note(entries: Sequence[object]) -> str:
    """What happened to each registration at the close after a failed start:
    the first :data:`_NOTE_NAMED` by name, then the count of every outcome
    (a note stays short with thousands of registrations)."""
    named = ", ".join(_describe_entry(entry) for entry in entries[:_NOTE_NAMED])
    if len(entries) <= _NOTE_NAMED:
        return f"registrations at close: {named}"
    counts = Counter(str(_outcome_of(entry)) for entry in entries)
    summary = ", ".join(f"{outcome}={n}" for outcome, n in sorted(counts.items()))
    return (
        f"registrations at close: {named} and {len(entries) - _NOTE_NAMED} more; "
        f"all {len(entries)}: {summary}"
    )


def _outcome_of(entry: object) -> object:
    outcome = getattr(entry, "outcome", None)
    return getattr(outcome, "value", outcome)


def _describe_entry(entry: object) -> str:
    return f"{getattr(entry, 'name', '?')}={_outcome_of(entry)}"
