"""The provider interface: what a registry backend implements.

A provider is small on purpose. It never starts tasks of its own: the owner
calls :meth:`Provider.query` for one complete listing, starts
:meth:`Provider.watch` in its own task group when the provider declares
watch streams, and drives the registration calls from the registration
lifecycle. Every failure is one of the typed :class:`~nadisc.ProviderFailure`
outcomes, so the evidence rules can tell "incomplete" (grace may apply) from
"revoked", "invalid" and "over capacity" (no grace).

Providers are found through the ``nadisc.providers`` entry-point group: the
entry point names a :class:`ProviderFactory`. ``static`` and ``dns`` are built
in; ``etcd`` and ``consul`` ship in their own import packages.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Protocol

from ._errors import LifecycleError, OutcomeUnknown, RegistrationRejected
from ._instance import EvidenceKind, ProviderSnapshot

if TYPE_CHECKING:
    from anyio.abc import TaskStatus
    from pydantic import BaseModel

    from ._errors import ProviderFailure

__all__ = [
    "Capabilities",
    "ConnectionContext",
    "DiscoveryOnlyProvider",
    "HealthCheck",
    "HealthStatus",
    "ObservationSink",
    "Provider",
    "ProviderFactory",
    "Registered",
    "RegistrationRecord",
    "RenewalOutcomeUnknown",
]

_EMPTY: Mapping[str, str] = MappingProxyType({})


def _check_renew_within(within: object) -> None:
    if within is not None and (
        isinstance(within, bool)
        or not isinstance(within, int | float)
        or not (math.isfinite(within) and within > 0)
    ):
        raise ValueError(f"renew_within must be a finite number of seconds > 0, not {within!r}")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a provider can do; the owner plans around these, never around its type."""

    evidence: EvidenceKind
    #: The provider implements register/renew/check/deregister.
    registration: bool = False
    #: Long watch streams one ``watch()`` holds (0: no watch, poll only;
    #: Kubernetes holds two: Service and EndpointSlice).
    watch_streams: int = 0
    #: Every watch of the connection rides on the same ``watch_streams``
    #: streams (etcd's one watch over the common prefix): the owner counts
    #: them once per connection while any observation watches, not once per
    #: observation.
    shared_watch: bool = False
    #: A watch's first listing takes the listing of the query the owner
    #: made just before it, when nothing changed in between, and waits for
    #: that query while it is in flight. The owner then starts a watch
    #: session's query and its watch together: the watch is open about
    #: when the query answers, not a stream set-up later, so a change made
    #: right after ``observe()`` returns reaches a watch already following.
    watch_takes_query: bool = False
    #: Repeating a renewal with the same identity and payload is harmless.
    idempotent_renewal: bool = False
    #: Seconds within which a registration must be renewed again to stay
    #: alive (an etcd lease: a fraction of its TTL). The registration runner
    #: renews at ``min(monitor_interval, renew_within)``; None: the
    #: connection's ``monitor_interval_ms`` alone paces renewals.
    renew_within: float | None = None
    #: Registering the same record again, with the same identity, replaces
    #: it and cannot create a second one (an upsert keyed by the record's
    #: identity: Consul's service ID, Nacos's ip:port:cluster). A
    #: re-registration whose answer was lost is then repeated with the same
    #: record. Not for registries where each registration takes a new lease
    #: (etcd): a repeat there may leave a second, orphaned record.
    idempotent_register: bool = False
    #: A removal can be addressed with the record alone, without the handle
    #: an acknowledged registration returned (Consul deregisters by service
    #: ID, Nacos deletes by ip:port:cluster). ``deregister`` is then also
    #: called for a registration whose outcome is unknown, with a
    #: :class:`Registered` whose ``handle`` is empty.
    deregister_without_handle: bool = False

    def __post_init__(self) -> None:
        _check_renew_within(self.renew_within)


class RenewalOutcomeUnknown(OutcomeUnknown):
    """A renewal that can only refresh a record the registry still holds (a
    Consul TTL ``check/pass``, a Nacos light beat) lost its answer.

    Such a write may still land, but it cannot create a record: the registry
    answers "not found" to it once the record is gone. A provider raises it
    instead of :class:`~nadisc.OutcomeUnknown` from ``renew`` when the lost
    write was of that kind; the lifecycle then treats the renewal as
    unknown (repeated only with ``idempotent_renewal``, Active again only
    after an acknowledged renewal and a fresh HEALTHY check) without
    recording a residual risk. A renewal that may re-create the record (a
    re-applied registration, a heartbeat carrying the full instance) raises
    plain ``OutcomeUnknown``.
    """


@dataclass(frozen=True, slots=True)
class ConnectionContext:
    """What the owner tells a provider about the connection it serves."""

    name: str
    #: Seconds one operation may take, queueing included.
    request_timeout: float
    max_instances_per_service: int
    #: Bytes of one response body the provider may read before decoding.
    max_response_bytes: int


class ObservationSink(Protocol):
    """Where a watch reports. Both calls are synchronous and never block."""

    def publish(self, snapshot: ProviderSnapshot) -> None:
        """A complete listing was observed now."""

    def fail(self, failure: ProviderFailure) -> None:
        """The watch could not keep the listing complete (typed outcome)."""

    def refresh(self) -> None:
        """The registry confirmed, now, that nothing changed (progress notify)."""


class HealthStatus(enum.Enum):
    """A registration's health as the registry reports it on a check."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    MISSING = "missing"
    DISABLED = "disabled"


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """A health check the registry should run (or expect) for a registration."""

    kind: str  # "http", "tcp" or "ttl"
    interval: float = 10.0
    #: HTTP path (kind "http"); the URL is built from the record's address.
    path: str | None = None
    #: Registry-side cleanup after this long critical (Consul: >= 60 s).
    deregister_after: float | None = None
    #: TTL checks: the registry marks the check critical after this long.
    ttl: float | None = None


@dataclass(frozen=True, slots=True)
class RegistrationRecord:
    """The frozen payload of one registration: identity and health, nothing else.

    Renewals repeat exactly this record: same identity, same health payload.
    """

    registration: str  # plan name, for messages
    service: str  # remote service name
    instance_id: str
    host: str
    port: int
    weight: float = 1.0
    metadata: Mapping[str, str] = field(default_factory=lambda: _EMPTY, hash=False)
    tags: tuple[str, ...] = ()
    check: HealthCheck | None = None
    ephemeral: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, MappingProxyType):
            object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))


@dataclass(frozen=True, slots=True)
class Registered:
    """A registration the registry acknowledged. ``handle`` is provider-owned
    (an etcd lease id, a Consul check id...). ``renew_within``: the pace the
    registry asked of *this* registration (Nacos's ``clientBeatInterval``);
    when set it replaces ``Capabilities.renew_within`` from the next renewal
    on, so a pace learned mid-run re-paces a registration already running."""

    record: RegistrationRecord
    handle: str
    renew_within: float | None = None

    def __post_init__(self) -> None:
        _check_renew_within(self.renew_within)


class Provider(Protocol):
    """One registry backend serving one named connection.

    Optional: ``async def serve(self) -> None``. A provider that has it gets
    one task of the owner's for it: started when the owner opens, cancelled
    when it closes (after the registrations were drained, before
    :meth:`aclose`). It is where a provider keeps what must be owned by a
    task for longer than one call (the etcd provider's gRPC channel); calls
    made before it is ready, or without an owner, must work without it. It
    must not raise: an exception is logged by type and the owner goes on.
    """

    @property
    def capabilities(self) -> Capabilities: ...

    async def prepare(self, deadline: float) -> None:
        """Check reachability and credentials once at startup (raise ProviderFailure)."""

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        """One complete listing of ``service`` (its remote name), or a ProviderFailure."""

    async def watch(
        self, service: str, sink: ObservationSink, *, task_status: TaskStatus[None]
    ) -> None:
        """Report complete listings to ``sink`` until cancelled.

        Only called when ``capabilities.watch_streams > 0``. Calls
        ``task_status.started()`` once the stream is established. Failures are
        reported through ``sink.fail`` and retried by the provider with the
        backoff it is given; the method returns only when cancelled or when it
        cannot go on (raise).
        """

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        """Write the registration. ``OutcomeUnknown`` when the answer was lost."""

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        """Renew (keepalive, heartbeat, TTL pass). ``LeaseLost`` if the registry
        dropped it; may return an updated handle."""

    async def check(self, registered: Registered, deadline: float) -> HealthStatus:
        """Ask the registry how it sees the registration now."""

    async def deregister(self, registered: Registered, deadline: float) -> None:
        """Remove the registration. Acknowledged removal does not prove that an
        earlier, lost write will not land later: the lifecycle keeps track."""

    async def aclose(self) -> None:
        """Release connections. Idempotent."""


class DiscoveryOnlyProvider:
    """A base for providers that only discover (no watch stream, no registration).

    Subclasses implement ``capabilities``, ``prepare``, ``query`` and
    ``aclose``; ``watch`` and the registration calls refuse with a typed error
    naming :attr:`provider_name`. The owner never calls them for such a
    provider (its capabilities say so); the refusals guard direct use.
    """

    provider_name: ClassVar[str] = "this"

    async def watch(
        self, service: str, sink: ObservationSink, *, task_status: TaskStatus[None]
    ) -> None:
        raise LifecycleError(f"the {self.provider_name} provider holds no watch streams")

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        raise self._cannot_register()

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        raise self._cannot_register()

    async def check(self, registered: Registered, deadline: float) -> HealthStatus:
        raise self._cannot_register()

    async def deregister(self, registered: Registered, deadline: float) -> None:
        raise self._cannot_register()

    def _cannot_register(self) -> RegistrationRejected:
        return RegistrationRejected(f"the {self.provider_name} provider cannot register instances")


class ProviderFactory(Protocol):
    """The object a ``nadisc.providers`` entry point names."""

    @property
    def name(self) -> str: ...

    @property
    def settings_model(self) -> type[BaseModel]:
        """Validates the connection's provider block (``connections.<name>.<provider>``)."""

    def create(self, context: ConnectionContext, settings: BaseModel) -> Provider: ...
