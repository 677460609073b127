"""Registrations: frozen plans, the per-registration runner, and the set the owner drives.

Lifecycle, as the owner drives it::

    specs = resolve_registrations(config, listeners={"web": ("10.0.0.5", 8080)},
                                  eligibility={"web": web_eligibility})
    registrations = RegistrationSet()
    registrations.freeze(specs, connections)            # validates everything, writes nothing
    await registrations.publish(task_group, providers, deadline)   # startup_required -> Active
    ...
    registrations.begin_quiesce(deadline)               # sync: no new writes, deregister
    await registrations.wait_drained()
    registrations.report()                              # honest per-registration outcome

**Plans.** :func:`RegistrationSet.freeze` checks the whole plan before any
write: the connection exists and can register, the service alias is bound,
listener and eligibility references resolve, the advertised address is
routable (``0.0.0.0``, ``::``, multicast, broadcast and link-local are
refused; loopback only with ``allow_loopback=True``), and no two
registrations share a backend key (connection + remote service + instance
id, or connection + remote service + address). Errors are
:class:`~nadisc.RegistrationError` naming the registration and the config
path ``discovery.registrations.<name>.<field>``.

**Runner.** One child task per registration, started in the task group the
owner passes to :meth:`RegistrationSet.publish` (never one of our own). The
decisions come from :mod:`nadisc._registration_state`; the runner only
performs writes and checks and reports their outcomes:

* registration waits for local eligibility, then writes once; an unknown
  outcome of that first write blocks it for good (never re-created; a
  WARNING names it), a rejection fails it;
* every ``monitor_interval`` (or sooner: ``Capabilities.renew_within``, when
  the provider's lease needs it) it renews (only while locally eligible: the
  renewal is the health publication) and checks health; a HEALTHY check
  grants ``observation_grace`` of evidence;
* a renewal whose answer was lost is repeated with the *same* record and
  bounded, jittered exponential backoff (``retry.initial_backoff_ms`` up to
  ``retry.max_backoff_ms``, never later than a lease's ``renew_within``),
  only for providers with ``idempotent_renewal``; others stay blocked in
  ``OUTCOME_UNKNOWN``. A renewal the provider reports as unable to create
  the record (``RenewalOutcomeUnknown``) leaves no residual risk. A renewal
  that definitely did not apply waits out the same backoff before it is
  sent again, while the checks keep their pace;
* ``LeaseLost`` re-registers under a new lease (see the state module for
  why that is never based on an unknown write); a re-registration whose
  answer was lost is repeated with the same record, with backoff, only for
  providers with ``idempotent_register``;
* writes in flight are shielded from quiesce (bounded by their own
  deadline, shortened to the shutdown deadline), so a registration that
  lands during shutdown is still removed; a write whose outcome is unknown
  is removed at close by providers with ``deregister_without_handle``.

**Operation bound.** Every registry call of a runner (first write,
renewal, health check, deregistration) waits for a turn under the owner's
``max_parallel_operations`` limiter (:meth:`RegistrationSet.use_operations`),
first come first served; its deadline is computed when the turn starts, so
time spent queued never makes a write time out. A write and the check that
confirms it share one turn (registrations complete one after another), and
a call still queued when quiesce begins is never sent. A startup set that
misses the publish deadline is reported with how many were confirmed and
how many never got their first write.

**Cost.** One task per registration, one provider call per operation, O(1)
work per event; :meth:`RegistrationSet.registrations` is O(n). With N
registrations and the bound P, a round of renewals takes about N / P
registry round trips.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import logging
import math
import random
import re
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, TypeVarTuple, Unpack

import anyio
import anyio.lowlevel

from . import _registration_state as sm
from ._eligibility import Eligibility
from ._errors import (
    DeadlineExceeded,
    IdentityRevoked,
    InvalidSnapshot,
    LeaseLost,
    LifecycleError,
    OutcomeUnknown,
    ProviderFailure,
    QualifierError,
    RegistrationError,
    RegistrationRejected,
)
from ._instance import canonical_host, numeric_reading
from ._journal import RegistrationJournal
from ._provider import (
    Capabilities,
    HealthCheck,
    HealthStatus,
    Provider,
    Registered,
    RegistrationRecord,
    RenewalOutcomeUnknown,
)
from ._registration_state import RegistrationState

if TYPE_CHECKING:
    from ._config import ConnectionConfig, DiscoveryConfig, RegistrationConfig

__all__ = [
    "CloseOutcome",
    "ConnectionPlan",
    "FrozenRegistration",
    "OwnerRegistrations",
    "RegistrationCloseEntry",
    "RegistrationSet",
    "RegistrationSpec",
    "RegistrationStatus",
    "RegistrationTiming",
    "TaskSpawner",
    "resolve_registrations",
]

logger = logging.getLogger(__name__)

_EMPTY: Mapping[str, str] = MappingProxyType({})
#: How often a registration waiting for eligibility re-reads a check-based
#: eligibility (channels also wake it on every explicit update).
_ELIGIBILITY_POLL = 0.25
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)
_LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback", "localhost.localdomain"})
#: A last label resolvers and URL parsers read as (part of) an IPv4 number.
_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")
#: NAT64 prefixes (well-known and local-use) sit inside the reserved ::/8
#: but carry routable IPv4 addresses.
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))


_PosArgs = TypeVarTuple("_PosArgs")


class TaskSpawner(Protocol):
    """Anything that starts child tasks: an anyio ``TaskGroup`` or a trio ``Nursery``."""

    def start_soon(
        self,
        func: Callable[[Unpack[_PosArgs]], Coroutine[object, object, object]],
        *args: Unpack[_PosArgs],  # noqa: UP044 - the spelling anyio and trio use
        name: object = None,
    ) -> object: ...


def _path(name: str, field_name: str | None = None) -> str:
    base = f"discovery.registrations.{name}"
    return f"{base}.{field_name}" if field_name else base


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True, slots=True)
class RegistrationTiming:
    """Per-connection timing of the registration lifecycle, in seconds.

    Defaults match the connection config: ``monitor_interval_ms`` 5000,
    ``observation_grace_ms`` 15000, ``deregister_timeout_ms`` 3000,
    ``request_timeout_ms`` 3000, ``retry.initial_backoff_ms`` 1000,
    ``retry.max_backoff_ms`` 30000.
    """

    monitor_interval: float = 5.0
    observation_grace: float = 15.0
    deregister_timeout: float = 3.0
    request_timeout: float = 3.0
    initial_backoff: float = 1.0
    max_backoff: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "monitor_interval",
            "observation_grace",
            "deregister_timeout",
            "request_timeout",
            "initial_backoff",
            "max_backoff",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number of seconds")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0")
        if self.initial_backoff > self.max_backoff:
            raise ValueError("initial_backoff must not exceed max_backoff")

    @classmethod
    def from_config(cls, connection: ConnectionConfig) -> RegistrationTiming:
        """Read the timing fields of a ``ConnectionConfig`` (milliseconds)."""
        return cls(
            monitor_interval=connection.monitor_interval_ms / 1000,
            observation_grace=connection.observation_grace_ms / 1000,
            deregister_timeout=connection.deregister_timeout_ms / 1000,
            request_timeout=connection.request_timeout_ms / 1000,
            initial_backoff=connection.retry.initial_backoff_ms / 1000,
            max_backoff=connection.retry.max_backoff_ms / 1000,
        )


def renewal_interval(
    timing: RegistrationTiming, capabilities: Capabilities, registered: Registered | None = None
) -> float:
    """Seconds between renewals: ``monitor_interval``, shortened to the
    provider's ``renew_within`` when it declares one (a lease TTL must not
    lapse between two renewals). The registration's own pace, when the
    registry gave one with the last acknowledged write
    (``Registered.renew_within``), replaces the provider's."""
    within = capabilities.renew_within
    if registered is not None and registered.renew_within is not None:
        within = registered.renew_within
    if within is None:
        return timing.monitor_interval
    return min(timing.monitor_interval, within)


@dataclass(frozen=True, slots=True)
class ConnectionPlan:
    """What freezing needs to know about one connection."""

    capabilities: Capabilities
    #: Service bindings: alias -> remote service name.
    bindings: Mapping[str, str]
    timing: RegistrationTiming = field(default_factory=RegistrationTiming)


ConnectionPlanLike = (
    ConnectionPlan
    | tuple[Capabilities, Mapping[str, str]]
    | tuple[Capabilities, Mapping[str, str], RegistrationTiming]
)


def _as_plan(value: ConnectionPlanLike) -> ConnectionPlan:
    if isinstance(value, ConnectionPlan):
        return value
    if len(value) == 2:
        return ConnectionPlan(value[0], value[1])
    return ConnectionPlan(value[0], value[1], value[2])


@dataclass(frozen=True, slots=True)
class RegistrationSpec:
    """One registration target, as a host or the config describes it.

    ``ip`` / ``port`` default to the bound address of the listener
    (``listener_ref``, which may be omitted when exactly one listener
    exists); ``eligibility`` defaults to the entry named ``eligibility_ref``,
    itself defaulting to the listener's name. ``instance_id`` defaults to
    ``<remote service>-<ip>-<port>``. ``allow_loopback`` lets a loopback
    address through (local development only: remote peers cannot reach it).
    """

    name: str
    service_name: str
    qualifier: str = "primary"
    listener_ref: str | None = None
    eligibility_ref: str | None = None
    ip: str | None = None
    port: int | None = None
    startup_required: bool = True
    readiness_critical: bool = False
    weight: float = 1.0
    metadata: Mapping[str, str] = field(default_factory=lambda: _EMPTY, hash=False)
    tags: tuple[str, ...] = ()
    instance_id: str | None = None
    check: HealthCheck | None = None
    ephemeral: bool = True
    allow_loopback: bool = False
    eligibility: Eligibility | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, MappingProxyType):
            object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))
        if not isinstance(self.tags, tuple):
            object.__setattr__(self, "tags", tuple(self.tags))


@dataclass(frozen=True, slots=True)
class FrozenRegistration:
    """A validated registration: everything the runner needs, immutable."""

    name: str
    qualifier: str
    service_alias: str
    record: RegistrationRecord
    eligibility: Eligibility = field(compare=False)
    startup_required: bool
    readiness_critical: bool
    capabilities: Capabilities
    timing: RegistrationTiming


def resolve_registrations(
    config: DiscoveryConfig | Mapping[str, RegistrationConfig],
    listeners: Mapping[str, tuple[str, int]],
    eligibility: Mapping[str, Eligibility],
    *,
    allow_loopback: bool = False,
) -> list[RegistrationSpec]:
    """Turn ``discovery.registrations`` into specs, resolving listener and
    eligibility references. Raises :class:`~nadisc.RegistrationError` naming
    the config path of the first bad reference; nothing is written."""
    registrations: Mapping[str, RegistrationConfig]
    if isinstance(config, Mapping):
        registrations = config
    else:
        registrations = config.registrations
    specs: list[RegistrationSpec] = []
    for name, entry in registrations.items():
        listener_ref = entry.listener_ref
        if listener_ref is None and len(listeners) == 1:
            listener_ref = next(iter(listeners))
        if listener_ref is not None and listener_ref not in listeners:
            raise RegistrationError(
                name,
                f"unknown listener {listener_ref!r} (bound: {sorted(listeners)})"
                if listeners
                else f"listener {listener_ref!r} is referenced but no bound listeners were "
                "given: resolve the plan after the listeners are bound and pass them",
                path=_path(name, "listener_ref"),
            )
        eligibility_ref = entry.eligibility_ref or listener_ref
        if eligibility_ref is None:
            raise RegistrationError(
                name,
                "no eligibility: set eligibility_ref or listener_ref",
                path=_path(name, "eligibility_ref"),
            )
        source = eligibility.get(eligibility_ref)
        if source is None:
            raise RegistrationError(
                name,
                f"unknown eligibility {eligibility_ref!r} (known: {sorted(eligibility)})"
                if eligibility
                else f"eligibility {eligibility_ref!r} is referenced but no local "
                "eligibilities were given",
                path=_path(name, "eligibility_ref"),
            )
        if not isinstance(source, Eligibility):
            raise RegistrationError(
                name,
                f"eligibility {eligibility_ref!r} must be an nadisc.Eligibility, "
                f"not {type(source).__name__}",
                path=_path(name, "eligibility_ref"),
            )
        ip, port = _advertised_address(name, entry, listener_ref, listeners)
        specs.append(
            RegistrationSpec(
                name=name,
                service_name=entry.service_name,
                qualifier=entry.qualifier,
                listener_ref=listener_ref,
                eligibility_ref=eligibility_ref,
                ip=ip,
                port=port,
                startup_required=entry.startup_required,
                readiness_critical=entry.readiness_critical,
                weight=entry.weight,
                metadata=dict(entry.metadata),
                tags=tuple(entry.tags),
                instance_id=entry.instance_id,
                allow_loopback=allow_loopback,
                eligibility=source,
            )
        )
    return specs


def _advertised_address(
    name: str,
    entry: RegistrationConfig,
    listener_ref: str | None,
    listeners: Mapping[str, tuple[str, int]],
) -> tuple[str | None, int | None]:
    """The address a config entry advertises: its own ``ip``, else the bound
    listener's host (never a wildcard); ``advertised_port``, else the bound
    port. An explicit ``port`` must equal the bound one."""
    bound = listeners.get(listener_ref) if listener_ref is not None else None
    ip = entry.ip
    port = entry.port
    if bound is not None:
        host, bound_port = bound
        if port is not None and port != bound_port:
            raise RegistrationError(
                name,
                f"port {port} is configured but listener {listener_ref!r} is bound to port "
                f"{bound_port}: drop port (the bound one is used), or set advertised_port "
                "for a mapped port (NAT, containers)",
                path=_path(name, "port"),
            )
        if ip is None:
            if _is_wildcard(host):
                raise RegistrationError(
                    name,
                    f"listener {listener_ref!r} is bound to the wildcard address {host}, which "
                    "is never advertised: give the listener an advertised host or set ip",
                    path=_path(name, "ip"),
                )
            ip = host
        port = bound_port
    if entry.advertised_port is not None:
        port = entry.advertised_port
    return ip, port


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host in ("", "*")


def _check_address(name: str, ip: str, *, allow_loopback: bool) -> None:
    hint = "configure the advertised address (the one peers can reach) explicitly"
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        _check_host_name(name, ip, allow_loopback=allow_loopback, hint=hint)
        return
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    problem: str | None = None
    if address.is_unspecified:
        problem = "is the unspecified (wildcard bind) address"
    elif address.is_multicast:
        problem = "is a multicast address"
    elif isinstance(address, ipaddress.IPv4Address) and address == ipaddress.IPv4Address(
        "255.255.255.255"
    ):
        problem = "is the broadcast address"
    elif address.is_link_local:
        problem = "is link-local and not routable"
    elif isinstance(address, ipaddress.IPv4Address) and address in _THIS_NETWORK:
        problem = "is in 0.0.0.0/8 ('this network'), which is not routable"
    elif isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        problem = "is an IPv6 site-local address (deprecated, not routable)"
    elif address.is_loopback:
        if not allow_loopback:
            problem = "is a loopback address (set allow_loopback for local development)"
    elif address.is_reserved and not (
        isinstance(address, ipaddress.IPv6Address) and any(address in n for n in _NAT64)
    ):
        problem = "is a reserved address"
    if problem is not None:
        raise RegistrationError(name, f"{ip} {problem}; {hint}", path=_path(name, "ip"))


def _check_host_name(name: str, host: str, *, allow_loopback: bool, hint: str) -> None:
    """A host name must look like one, and must not be a name resolvers turn
    into an unroutable address: numeric shorthands (``"0"``, ``"127.1"``,
    ``"2130706433"``, ``"0x7f000001"``), or loopback names (``localhost``,
    ``*.localhost``) unless ``allow_loopback``."""
    path = _path(name, "ip")
    if not _HOSTNAME.match(host):
        raise RegistrationError(
            name, f"{host!r} is neither an IP address nor a host name; {hint}", path=path
        )
    bare = host.lower().rstrip(".")
    last = bare.rsplit(".", 1)[-1]
    numeric = numeric_reading(host)
    if numeric is not None:
        what = f" (read as {numeric})" if numeric else ""
        raise RegistrationError(
            name,
            f"{host!r} is a numeric host name{what} that resolvers and URL parsers "
            f"interpret as an IPv4 number, not a name; {hint} as a dotted-quad "
            "address or a real host name",
            path=path,
        )
    if bare in _LOOPBACK_NAMES or last == "localhost":
        if allow_loopback:
            return
        raise RegistrationError(
            name,
            f"{host!r} is a loopback name that peers cannot reach; {hint} "
            "(or set allow_loopback for local development)",
            path=path,
        )


def _freeze_one(
    spec: RegistrationSpec,
    connections: Mapping[str, ConnectionPlan],
    listeners: Mapping[str, tuple[str, int]],
    eligibility: Mapping[str, Eligibility],
    *,
    listeners_given: bool,
) -> FrozenRegistration:
    name = spec.name
    if not isinstance(name, str) or not _NAME.match(name):
        raise RegistrationError(
            str(name),
            "registration names are letters, digits, '_', '.', '-'",
            path=_path(str(name)),
        )
    plan = connections.get(spec.qualifier)
    if plan is None:
        raise RegistrationError(
            name,
            f"unknown connection {spec.qualifier!r} (known: {sorted(connections)})",
            path=_path(name, "qualifier"),
        )
    if not plan.capabilities.registration:
        raise RegistrationError(
            name,
            f"connection {spec.qualifier!r} uses a provider that cannot register",
            path=_path(name, "qualifier"),
        )
    remote = plan.bindings.get(spec.service_name)
    if remote is None:
        raise RegistrationError(
            name,
            f"service alias {spec.service_name!r} is not bound on connection {spec.qualifier!r}",
            path=_path(name, "service_name"),
        )
    listener_ref = spec.listener_ref
    if listener_ref is None and len(listeners) == 1:
        listener_ref = next(iter(listeners))
    bound: tuple[str, int] | None = None
    if listener_ref is not None:
        bound = listeners.get(listener_ref)
        # Without a listener map (specs already resolved from config, with
        # their address), a named listener is not checked again here.
        checkable = listeners_given or spec.ip is None or spec.port is None
        if bound is None and checkable:
            raise RegistrationError(
                name,
                f"unknown listener {listener_ref!r} (bound: {sorted(listeners)})",
                path=_path(name, "listener_ref"),
            )
    elif spec.ip is None or spec.port is None:
        raise RegistrationError(
            name,
            "no address: give ip and port, or a listener_ref"
            + (" (several listeners are bound)" if listeners else ""),
            path=_path(name, "listener_ref"),
        )
    ip = spec.ip if spec.ip is not None else (bound[0] if bound else None)
    port = spec.port if spec.port is not None else (bound[1] if bound else None)
    if ip is None or port is None:  # pragma: no cover - guarded above
        raise RegistrationError(name, "no address", path=_path(name, "ip"))
    if not isinstance(ip, str) or not ip or ip != ip.strip():
        raise RegistrationError(name, "ip must be a non-empty string", path=_path(name, "ip"))
    _check_address(name, ip, allow_loopback=spec.allow_loopback)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise RegistrationError(name, f"port {port!r} is not in 1-65535", path=_path(name, "port"))
    source = spec.eligibility
    if source is None:
        ref = spec.eligibility_ref or listener_ref
        if ref is None:
            raise RegistrationError(
                name,
                "no eligibility: pass eligibility, eligibility_ref or listener_ref",
                path=_path(name, "eligibility_ref"),
            )
        source = eligibility.get(ref)
        if source is None:
            raise RegistrationError(
                name,
                f"unknown eligibility {ref!r} (known: {sorted(eligibility)})",
                path=_path(name, "eligibility_ref"),
            )
    if not isinstance(source, Eligibility):
        raise RegistrationError(
            name, "eligibility must be an nadisc.Eligibility", path=_path(name, "eligibility_ref")
        )
    weight = spec.weight
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not (math.isfinite(weight) and weight > 0)
    ):
        raise RegistrationError(name, "weight must be finite and > 0", path=_path(name, "weight"))
    for key, value in spec.metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise RegistrationError(
                name, "metadata keys and values must be strings", path=_path(name, "metadata")
            )
    if not all(isinstance(tag, str) and tag for tag in spec.tags):
        raise RegistrationError(name, "tags must be non-empty strings", path=_path(name, "tags"))
    instance_id = spec.instance_id if spec.instance_id is not None else f"{remote}-{ip}-{port}"
    if not isinstance(instance_id, str) or not instance_id:
        raise RegistrationError(
            name, "instance_id must be a non-empty string", path=_path(name, "instance_id")
        )
    record = RegistrationRecord(
        registration=name,
        service=remote,
        instance_id=instance_id,
        host=ip,
        port=port,
        weight=float(weight),
        metadata=spec.metadata,
        tags=spec.tags,
        check=spec.check,
        ephemeral=spec.ephemeral,
    )
    return FrozenRegistration(
        name=name,
        qualifier=spec.qualifier,
        service_alias=spec.service_name,
        record=record,
        eligibility=source,
        startup_required=bool(spec.startup_required),
        readiness_critical=bool(spec.readiness_critical),
        capabilities=plan.capabilities,
        timing=plan.timing,
    )


def freeze_plan(
    specs: Iterable[RegistrationSpec],
    connections: Mapping[str, ConnectionPlanLike],
    *,
    listeners: Mapping[str, tuple[str, int]] | None = None,
    eligibility: Mapping[str, Eligibility] | None = None,
) -> tuple[FrozenRegistration, ...]:
    """Validate a whole plan; all or nothing. See :meth:`RegistrationSet.freeze`."""
    plans = {q: _as_plan(v) for q, v in connections.items()}
    frozen: list[FrozenRegistration] = []
    names: set[str] = set()
    by_identity: dict[tuple[str, str, str], str] = {}
    by_address: dict[tuple[str, str, str, int], str] = {}
    for spec in specs:
        if not isinstance(spec, RegistrationSpec):
            raise RegistrationError("?", f"expected a RegistrationSpec, got {type(spec).__name__}")
        item = _freeze_one(
            spec, plans, listeners or {}, eligibility or {}, listeners_given=listeners is not None
        )
        if item.name in names:
            raise RegistrationError(
                item.name, "registration name given twice", path=_path(item.name)
            )
        names.add(item.name)
        record = item.record
        identity = (item.qualifier, record.service, record.instance_id)
        other = by_identity.get(identity)
        if other is not None:
            raise RegistrationError(
                item.name,
                f"same backend key as registration {other!r}: connection {item.qualifier!r}, "
                f"service {record.service!r}, instance id {record.instance_id!r}",
                path=_path(item.name, "instance_id"),
            )
        by_identity[identity] = item.name
        address = (item.qualifier, record.service, canonical_host(record.host), record.port)
        other = by_address.get(address)
        if other is not None:
            raise RegistrationError(
                item.name,
                f"registers the same address as registration {other!r} on connection "
                f"{item.qualifier!r} for service {record.service!r}",
                path=_path(item.name, "port"),
            )
        by_address[address] = item.name
        frozen.append(item)
    return tuple(frozen)


# --------------------------------------------------------------------------- views


@dataclass(frozen=True, slots=True)
class RegistrationStatus:
    """Immutable view of one registration (no secrets: kinds, not messages)."""

    name: str
    qualifier: str
    service: str
    instance_id: str
    state: RegistrationState
    write: sm.WriteOutcome
    health: sm.HealthEvidence
    healthy_until: float | None
    eligible: bool
    epoch: int
    residual_risk: bool
    last_error: str | None
    startup_required: bool
    readiness_critical: bool


class CloseOutcome(enum.Enum):
    """What shutdown left behind for one registration."""

    #: Nothing was ever written.
    NOT_REGISTERED = "not_registered"
    #: Removed, acknowledged, and no earlier write can still land.
    DEREGISTERED = "deregistered"
    #: Removal acknowledged, but an earlier write may still land.
    RESIDUAL = "residual"
    #: A write's outcome is unknown and no removal could be addressed to it.
    OUTCOME_UNKNOWN = "outcome_unknown"
    #: The removal failed or did not finish within ``deregister_timeout``.
    UNREACHABLE = "unreachable"
    #: Cleanup has not run (yet): the registration is still in place.
    REGISTERED = "registered"


@dataclass(frozen=True, slots=True)
class RegistrationCloseEntry:
    """One registration's line in the close report."""

    name: str
    qualifier: str
    outcome: CloseOutcome
    state: RegistrationState
    #: A remote record may remain after shutdown.
    possibly_remaining: bool
    #: The instance is permanent (``ephemeral=False``): a remaining record
    #: will not expire on its own.
    permanent: bool
    last_error: str | None


def _close_outcome(records: sm.RegistrationRecords) -> CloseOutcome:
    write = records.write
    if write is sm.WriteOutcome.DEREGISTERED:
        if records.residual_risk:
            return CloseOutcome.RESIDUAL
        # Never acknowledged and no unknown write: nothing can exist remotely.
        return CloseOutcome.DEREGISTERED if records.acked_once else CloseOutcome.NOT_REGISTERED
    if write is sm.WriteOutcome.DEREGISTER_UNKNOWN:
        return CloseOutcome.UNREACHABLE
    if write is sm.WriteOutcome.UNKNOWN and not records.handle:
        return CloseOutcome.OUTCOME_UNKNOWN
    if write is sm.WriteOutcome.REJECTED and records.residual_risk:
        # Refused after a write whose answer was lost, and not removed.
        return CloseOutcome.OUTCOME_UNKNOWN
    if write is sm.WriteOutcome.NONE and not records.written:
        return CloseOutcome.NOT_REGISTERED
    return CloseOutcome.REGISTERED


# --------------------------------------------------------------------------- runtime


class _Registration:
    """Mutable runtime holder for one frozen registration (internal)."""

    __slots__ = (
        "active_scope",
        "done",
        "frozen",
        "records",
        "registered",
        "renew_at",
        "sent",
        "started",
        "turn",
        "wake",
        "write_scope",
    )

    def __init__(self, frozen: FrozenRegistration) -> None:
        self.frozen = frozen
        self.records = sm.RegistrationRecords()
        self.registered: Registered | None = None
        self.active_scope: anyio.CancelScope | None = None
        self.write_scope: anyio.CancelScope | None = None
        self.wake: anyio.Event | None = None
        self.started = False
        #: A first write was ever sent (False: still queued, or never eligible).
        self.sent = False
        #: The runner holds a turn under the operation bound right now.
        self.turn = False
        self.done = False
        #: A renewal that definitely did not apply is not sent again before
        #: this time (its backoff); checks go on meanwhile.
        self.renew_at = -math.inf


#: How long past a write's deadline the lifecycle's own bound waits for the
#: provider's answer to its timeout.
_WRITE_BACKSTOP = 0.1


def _kind(exc: BaseException) -> str:
    return type(exc).__name__


def _next_action(reg: _Registration) -> sm.Action:
    """:func:`~nadisc._registration_state.next_action` under the provider's capabilities."""
    capabilities = reg.frozen.capabilities
    return sm.next_action(
        reg.records,
        idempotent_renewal=capabilities.idempotent_renewal,
        idempotent_register=capabilities.idempotent_register,
        deregister_without_handle=capabilities.deregister_without_handle,
    )


def lease_pace(capabilities: Capabilities, registered: Registered | None) -> float | None:
    """Seconds within which the registration's lease needs a renewal (the
    registration's own pace, else the provider's ``renew_within``), or None
    when nothing lapses on a schedule of ours."""
    if registered is not None and registered.renew_within is not None:
        return registered.renew_within
    return capabilities.renew_within


@dataclass(frozen=True, slots=True)
class _WriteEvents:
    """How one kind of registry write maps its outcomes onto state events."""

    verb: str
    acked: Callable[[], sm.Event]
    unknown: Callable[[str], sm.Event]
    #: A lost answer of a write that cannot create the record
    #: (:class:`~nadisc._provider.RenewalOutcomeUnknown`).
    unknown_refresh: Callable[[str], sm.Event]
    failed: Callable[[str], sm.Event]
    #: The provider failure that is a definite answer of its own kind
    #: (a rejected registration, a lost lease) and its event.
    definite: type[ProviderFailure]
    definite_event: Callable[[str], sm.Event]


_REGISTER = _WriteEvents(
    verb="register",
    acked=sm.RegisterAcked,
    unknown=sm.RegisterUnknown,
    # A registration write always may create the record.
    unknown_refresh=sm.RegisterUnknown,
    failed=sm.RegisterFailed,
    definite=RegistrationRejected,
    definite_event=sm.RegisterRejected,
)
_RENEW = _WriteEvents(
    verb="renew",
    acked=sm.RenewAcked,
    unknown=sm.RenewUnknown,
    unknown_refresh=lambda error: sm.RenewUnknown(error, creates=False),
    failed=sm.RenewFailed,
    definite=LeaseLost,
    definite_event=sm.RenewLeaseLost,
)


class RegistrationSet:
    """The registrations of one owner: frozen once, published once, quiesced once.

    Not thread-safe; use from the event loop that runs the owner.
    ``rng`` drives the backoff jitter (inject a seeded one for tests).
    """

    def __init__(
        self,
        *,
        rng: random.Random | None = None,
        operations: anyio.CapacityLimiter | None = None,
    ) -> None:
        self._rng = rng or random.Random()
        #: The bound every registry call of a runner waits for (the owner's
        #: ``max_parallel_operations``); None: unbounded.
        self._operations = operations
        #: Runners waiting for a turn under ``operations`` right now.
        self._queued = 0
        self._regs: dict[str, _Registration] = {}
        # Filled by freeze; the probe holds the read-only view from the start.
        self._eligibility: dict[str, Eligibility] = {}
        self._eligibility_view: Mapping[str, Eligibility] = MappingProxyType(self._eligibility)
        self._frozen = False
        self._published = False
        self._quiescing = False
        self._quiesce_deadline: float | None = None
        self._epochs: dict[str, int] = {}
        self._changed: anyio.Event | None = None
        #: Renewal counts and state history, read by the observer.
        self.journal = RegistrationJournal()
        self._revoked: dict[str, anyio.Event] = {}
        self._running = 0
        self._drained: anyio.Event | None = None
        #: Names of registrations whose records changed, while publish waits.
        self._touched: set[str] | None = None

    # ----------------------------------------------------------------- plan

    def freeze(
        self,
        specs: Iterable[RegistrationSpec],
        connections: Mapping[str, ConnectionPlanLike],
        *,
        listeners: Mapping[str, tuple[str, int]] | None = None,
        eligibility: Mapping[str, Eligibility] | None = None,
    ) -> tuple[FrozenRegistration, ...]:
        """Validate and freeze the whole plan (see the module docstring).

        ``connections`` maps qualifier -> :class:`ConnectionPlan` or
        ``(capabilities, bindings[, timing])``. All or nothing: on error the
        set stays unfrozen. Freezing twice raises :class:`~nadisc.LifecycleError`.
        """
        if self._frozen:
            raise LifecycleError("registrations are already frozen")
        if self._quiescing:
            raise LifecycleError("registrations are quiescing")
        frozen = freeze_plan(specs, connections, listeners=listeners, eligibility=eligibility)
        self._regs = {item.name: _Registration(item) for item in frozen}
        self._eligibility.update((item.name, item.eligibility) for item in frozen)
        self._epochs = {item.qualifier: 0 for item in frozen}
        self._frozen = True
        return frozen

    @property
    def frozen(self) -> bool:
        return self._frozen

    def use_operations(self, limiter: anyio.CapacityLimiter) -> None:
        """Bound every registry call of the runners (first writes, renewals,
        checks, deregistrations) by ``limiter``; the owner passes its
        ``max_parallel_operations`` limiter. Waiters are served in arrival
        order. Only before :meth:`publish`."""
        if self._published:
            raise LifecycleError("the operation bound must be set before publish")
        self._operations = limiter

    @property
    def operations_queued(self) -> int:
        """Registry calls waiting for a turn under the operation bound now."""
        return self._queued

    @contextlib.asynccontextmanager
    async def _turn(self, reg: _Registration) -> AsyncIterator[None]:
        """One turn under the operation bound (FIFO). A registry call's own
        deadline is computed *inside* the turn: time spent queued never eats
        into it. Re-entrant per registration: a write and the check that
        confirms it run in one turn, so registrations complete one after
        another instead of all writing first and confirming last."""
        limiter = self._operations
        if limiter is None or reg.turn:
            yield
            return
        token = object()
        self._queued += 1
        try:
            await limiter.acquire_on_behalf_of(token)
        finally:
            self._queued -= 1
        reg.turn = True
        try:
            # A turn granted just as quiesce cancelled the runner is given
            # back at once: nothing is sent on it.
            await anyio.lowlevel.checkpoint_if_cancelled()
            yield
        finally:
            reg.turn = False
            limiter.release_on_behalf_of(token)

    def eligibilities(self) -> Mapping[str, Eligibility]:
        """Registration name -> its local eligibility, for the probe.

        A live read-only view: empty until :meth:`freeze`, filled by it, so a
        probe built before the plan is frozen answers for it afterwards. It
        holds local eligibility only, never a registration's own state."""
        return self._eligibility_view

    # -------------------------------------------------------------- publish

    async def publish(
        self,
        task_group: TaskSpawner,
        providers: Mapping[str, Provider],
        deadline: float,
    ) -> None:
        """Start one runner per registration in ``task_group`` and wait until
        every ``startup_required`` registration is Active.

        Raises :class:`~nadisc.RegistrationError` naming a startup-required
        registration that failed for good (rejected, or a first write with an
        unknown outcome), :class:`~nadisc.DeadlineExceeded` naming the ones
        still pending at ``deadline``. The runners keep running either way:
        the owner quiesces to stop them.
        """
        await anyio.lowlevel.checkpoint()
        if not self._frozen:
            raise LifecycleError("publish before freeze: freeze the registration plan first")
        if self._published:
            raise LifecycleError("registrations were already published")
        if self._quiescing:
            raise LifecycleError("registrations are quiescing")
        if not (isinstance(deadline, int | float) and math.isfinite(deadline)):
            raise DeadlineExceeded("publish: the deadline is not a finite number")
        if anyio.current_time() >= deadline:
            raise DeadlineExceeded("publish: the deadline had already passed")
        for reg in self._regs.values():
            if reg.frozen.qualifier not in providers:
                raise QualifierError(
                    f"registration {reg.frozen.name!r}: no provider for connection "
                    f"{reg.frozen.qualifier!r}"
                )
        self._published = True
        for reg in self._regs.values():
            reg.started = True
            self._running += 1
            task_group.start_soon(
                self._run,
                reg,
                providers[reg.frozen.qualifier],
                name=f"registration {reg.frozen.name}",
            )
        required = [r for r in self._regs.values() if r.frozen.startup_required]
        # Only registrations whose records changed are judged again after a
        # change (O(changes), not O(registrations) per change); once every
        # one was seen Active, all are judged together once more, since
        # evidence seen earlier may have lapsed meanwhile.
        pending = {r.frozen.name: r for r in required}
        self._touched = set()
        try:
            with anyio.CancelScope(deadline=deadline):
                candidates: Iterable[_Registration] = required
                while True:
                    if self._quiescing:
                        raise LifecycleError(
                            "quiesce began before the registrations were confirmed"
                        )
                    now = anyio.current_time()
                    for reg in list(candidates):
                        if self._startup_active(reg, now):
                            pending.pop(reg.frozen.name, None)
                    if not pending:
                        lapsed = [r for r in required if not self._startup_active(r, now)]
                        if not lapsed:
                            return
                        pending = {r.frozen.name: r for r in lapsed}
                    await self._wait_changed()
                    touched, self._touched = self._touched, set()
                    candidates = [pending[name] for name in touched if name in pending]
        finally:
            self._touched = None
        raise DeadlineExceeded(self._unconfirmed_message(required))

    def _startup_active(self, reg: _Registration, now: float) -> bool:
        """True when ``reg`` is Active; raises when it failed for good."""
        self._observe_eligibility(reg, now)
        state = sm.derive_state(reg.records, now)
        if state is RegistrationState.ACTIVE:
            return True
        action = _next_action(reg)
        if state is RegistrationState.FAILED or action is sm.Action.BLOCKED:
            raise RegistrationError(
                reg.frozen.name,
                f"startup registration failed: {state.value}"
                + (f" ({reg.records.last_error})" if reg.records.last_error else ""),
                path=_path(reg.frozen.name),
            )
        return False

    def _unconfirmed_message(self, required: Sequence[_Registration]) -> str:
        """Why publish ran out of time: how many startup-required registrations
        were confirmed, how many were never even sent (queued behind the
        operation bound), and the first few names still unconfirmed."""
        now = anyio.current_time()
        missing = [
            r for r in required if sm.derive_state(r.records, now) is not RegistrationState.ACTIVE
        ]
        never_sent = sum(1 for r in missing if not r.sent)
        shown = ", ".join(repr(r.frozen.name) for r in missing[:10])
        if len(missing) > 10:
            shown += f" and {len(missing) - 10} more"
        bound = (
            f" under max_parallel_operations={self._operations.total_tokens:g}"
            if self._operations is not None
            else ""
        )
        return (
            f"publish: {len(required) - len(missing)} of {len(required)} startup-required "
            f"registrations confirmed by the deadline; {never_sent} of the rest were still "
            f"waiting for their first write{bound}; not confirmed: {shown}"
        )

    # ------------------------------------------------------------- quiesce

    def begin_quiesce(self, deadline: float) -> None:
        """Stop new registrations, renewals and health confirmations now, and
        start deregistration (bounded by ``deadline`` and each connection's
        ``deregister_timeout``). Synchronous; idempotent (the first deadline wins)."""
        if self._quiescing:
            return
        if not (isinstance(deadline, int | float) and not math.isnan(deadline)):
            raise DeadlineExceeded("begin_quiesce: the deadline is not a number")
        self._quiescing = True
        self._quiesce_deadline = deadline
        now = anyio.current_time()
        for reg in self._regs.values():
            self._apply(reg, sm.QuiesceBegan(), now)
            if not reg.started:
                self._retire(reg, now)
                continue
            if reg.write_scope is not None:
                reg.write_scope.deadline = min(reg.write_scope.deadline, deadline)
            if reg.active_scope is not None:
                reg.active_scope.cancel()
        self._notify()
        self._check_drained()

    @property
    def quiescing(self) -> bool:
        return self._quiescing

    async def wait_drained(self) -> None:
        """Wait until every runner has finished its cleanup (immediately if
        none was started). Requires :meth:`begin_quiesce` (or the owner's task
        group being cancelled) to ever return."""
        await anyio.lowlevel.checkpoint()
        while self._running > 0:
            if self._drained is None:
                self._drained = anyio.Event()
            await self._drained.wait()

    def report(self) -> tuple[RegistrationCloseEntry, ...]:
        """Per-registration shutdown outcome, in plan order."""
        now = anyio.current_time()
        out: list[RegistrationCloseEntry] = []
        for reg in self._regs.values():
            outcome = _close_outcome(reg.records)
            out.append(
                RegistrationCloseEntry(
                    name=reg.frozen.name,
                    qualifier=reg.frozen.qualifier,
                    outcome=outcome,
                    state=sm.derive_state(reg.records, now),
                    possibly_remaining=outcome
                    not in (CloseOutcome.NOT_REGISTERED, CloseOutcome.DEREGISTERED),
                    permanent=not reg.frozen.record.ephemeral,
                    last_error=reg.records.last_error,
                )
            )
        return tuple(out)

    async def wait_changed(self) -> None:
        """Wait until any registration's records change (a state change, an
        outcome, new evidence). Always a checkpoint; re-read
        :meth:`registrations` afterwards."""
        await self._wait_changed()

    # ---------------------------------------------------------- identities

    def epoch(self, qualifier: str) -> int:
        """Current identity epoch of a connection (0 until a revocation)."""
        return self._epochs.get(qualifier, 0)

    def revoke_identity(self, qualifier: str) -> int:
        """The connection's identity was revoked: cancel the health evidence
        of all its registrations, start a new epoch, wake waiters of
        :meth:`identity_revoked`. Other connections are untouched. Returns the
        new epoch."""
        epoch = self._epochs.get(qualifier, 0) + 1
        self._epochs[qualifier] = epoch
        now = anyio.current_time()
        for reg in self._regs.values():
            if reg.frozen.qualifier == qualifier:
                self._apply(reg, sm.IdentityRevokedEvent(epoch), now)
                self._wake(reg)
        logger.warning("identity of connection %r revoked (epoch %d)", qualifier, epoch)
        event = self._revoked.pop(qualifier, None)
        if event is not None:
            event.set()
        self._notify()
        return epoch

    async def identity_revoked(self, qualifier: str, *, after_epoch: int | None = None) -> int:
        """Wait until the connection's identity epoch exceeds ``after_epoch``
        (default: the current one) and return the new epoch. Returns at once
        (after a checkpoint) if that already happened."""
        await anyio.lowlevel.checkpoint()
        floor = self.epoch(qualifier) if after_epoch is None else after_epoch
        while self.epoch(qualifier) <= floor:
            event = self._revoked.get(qualifier)
            if event is None:
                event = self._revoked[qualifier] = anyio.Event()
            await event.wait()
        return self.epoch(qualifier)

    # ------------------------------------------------------------ readiness

    def registrations(self, now: float | None = None) -> Mapping[str, RegistrationStatus]:
        """Immutable status of every registration at ``now`` (default: the
        clock), judged under the current identity epoch."""
        at = anyio.current_time() if now is None else now
        out: dict[str, RegistrationStatus] = {}
        for name, reg in self._regs.items():
            self._observe_eligibility(reg, at)
            r = reg.records
            out[name] = RegistrationStatus(
                name=name,
                qualifier=reg.frozen.qualifier,
                service=reg.frozen.record.service,
                instance_id=reg.frozen.record.instance_id,
                state=sm.derive_state(r, at),
                write=r.write,
                health=r.health,
                healthy_until=r.healthy_until,
                eligible=r.eligible,
                epoch=r.epoch,
                residual_risk=r.residual_risk,
                last_error=r.last_error,
                startup_required=reg.frozen.startup_required,
                readiness_critical=reg.frozen.readiness_critical,
            )
        return MappingProxyType(out)

    def ready(self, now: float | None = None) -> bool:
        """True when every ``readiness_critical`` registration is Active."""
        statuses = self.registrations(now)
        return all(
            s.state is RegistrationState.ACTIVE for s in statuses.values() if s.readiness_critical
        )

    def __repr__(self) -> str:
        now = anyio.current_time() if self._running else 0.0
        counts: dict[str, int] = {}
        for reg in self._regs.values():
            state = sm.derive_state(reg.records, now).value
            counts[state] = counts.get(state, 0) + 1
        inner = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        return f"<RegistrationSet registrations={len(self._regs)} {inner}>".replace(" >", ">")

    # ------------------------------------------------------------ internals

    def _apply(self, reg: _Registration, event: sm.Event, now: float) -> None:
        before = reg.records
        reg.records = sm.apply(before, event, now)
        self.journal.record(reg.frozen.name, event, reg.records, now)
        if reg.records != before:
            if self._touched is not None:
                self._touched.add(reg.frozen.name)
            self._notify()

    def _notify(self) -> None:
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    async def _wait_changed(self) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    def _wake(self, reg: _Registration) -> None:
        event, reg.wake = reg.wake, None
        if event is not None:
            event.set()

    def _observe_eligibility(self, reg: _Registration, now: float) -> bool:
        eligible = reg.frozen.eligibility.is_eligible(now)
        if eligible is not reg.records.eligible:
            self._apply(reg, sm.EligibilityObserved(eligible), now)
        return eligible

    def _retire(self, reg: _Registration, now: float) -> None:
        write = reg.records.write
        if write in (sm.WriteOutcome.NONE, sm.WriteOutcome.REJECTED) or (
            write in (sm.WriteOutcome.UNKNOWN, sm.WriteOutcome.LOST) and not reg.records.handle
        ):
            self._apply(reg, sm.Retired(), now)

    def _check_drained(self) -> None:
        if self._running == 0 and self._drained is not None:
            self._drained.set()
            self._drained = None

    async def _pause(self, reg: _Registration, delay: float, *, eligibility_wakes: bool) -> str:
        """Sleep up to ``delay`` seconds. Returns why it ended: ``"timeout"``,
        ``"revoked"`` (the connection's identity epoch moved) or
        ``"eligibility"`` (an explicit eligibility update, if asked for)."""
        reg.wake = anyio.Event()
        wake = reg.wake
        reason = "timeout"
        with anyio.move_on_after(delay):
            async with anyio.create_task_group() as tg:

                async def eligibility_changed() -> None:
                    nonlocal reason
                    await reg.frozen.eligibility.changed()
                    reason = "eligibility"
                    tg.cancel_scope.cancel()

                if eligibility_wakes:
                    tg.start_soon(eligibility_changed)
                await wake.wait()
                reason = "revoked"
                tg.cancel_scope.cancel()
        return reason

    async def _idle(
        self,
        reg: _Registration,
        provider: Provider,
        delay: float,
        *,
        until_eligible: bool = False,
    ) -> None:
        """Wait ``delay`` seconds. A revocation meanwhile triggers a check
        (never a write, and never shortens a backoff); with
        ``until_eligible``, an update that makes the registration eligible
        ends the wait early."""
        end = anyio.current_time() + delay
        while (now := anyio.current_time()) < end:
            step = end - now
            if until_eligible:
                # A check-based eligibility never signals: poll it.
                step = min(step, _ELIGIBILITY_POLL)
            reason = await self._pause(reg, step, eligibility_wakes=until_eligible)
            if (
                until_eligible
                and reason == "timeout"
                and self._observe_eligibility(reg, anyio.current_time())
            ):
                return
            if reason == "revoked":
                if reg.records.handle and reg.records.write in (
                    sm.WriteOutcome.ACKED,
                    sm.WriteOutcome.UNKNOWN,
                ):
                    await self._check(reg, provider)
            elif reason == "eligibility" and self._observe_eligibility(reg, anyio.current_time()):
                return

    async def _run(self, reg: _Registration, provider: Provider) -> None:
        try:
            with anyio.CancelScope() as scope:
                reg.active_scope = scope
                if self._quiescing:
                    scope.cancel()
                await self._active(reg, provider)
        finally:
            reg.active_scope = None
            try:
                await self._cleanup(reg, provider)
            finally:
                reg.done = True
                self._running -= 1
                self._notify()
                self._check_drained()

    # ----------------------------------------------------- the active phase

    async def _active(self, reg: _Registration, provider: Provider) -> None:
        timing = reg.frozen.timing

        # Renew often enough for the provider's lease as well as our own
        # monitoring: min(monitor_interval, capabilities.renew_within), or the
        # registration's own pace from its last acknowledged write.
        def renew_every() -> float:
            return renewal_interval(timing, reg.frozen.capabilities, reg.registered)

        def backoff() -> float:
            return sm.backoff_delay(
                max(1, reg.records.attempt), timing.initial_backoff, timing.max_backoff, self._rng
            )

        def renewal_retry() -> float:
            # The documented backoff, up to max_backoff, for a renewal that
            # was lost or did not apply; only a lease that would lapse first
            # (renew_within) brings the repeat forward.
            return sm.retry_delay(
                max(1, reg.records.attempt),
                timing.initial_backoff,
                timing.max_backoff,
                lease_pace(reg.frozen.capabilities, reg.registered),
                self._rng,
            )

        while True:
            self._observe_eligibility(reg, anyio.current_time())
            action = _next_action(reg)
            if action in (sm.Action.REGISTER, sm.Action.RETRY_REGISTER):
                # A retry repeats the same record (the provider's register is
                # an upsert by identity); eligibility was re-checked just above.
                async with self._turn(reg):
                    registered = await self._register(reg, provider)
                    if registered:
                        await self._check(reg, provider)
                if registered:
                    await self._idle(reg, provider, renew_every())
                elif reg.records.write in (sm.WriteOutcome.NONE, sm.WriteOutcome.LOST):
                    # The write definitely did not apply: retry after backoff.
                    await self._idle(reg, provider, backoff())
                elif (
                    reg.records.write is sm.WriteOutcome.UNKNOWN
                    and _next_action(reg) is not sm.Action.BLOCKED
                ):
                    # A re-registration's answer was lost: repeated later.
                    await self._idle(reg, provider, backoff())
                continue
            if action is sm.Action.RENEW and anyio.current_time() < reg.renew_at:
                # The last renewal definitely did not apply (never sent, or
                # refused as rate limited): it waits out its backoff, while
                # the checks keep their pace.
                async with self._turn(reg):
                    await self._check(reg, provider)
                left = reg.renew_at - anyio.current_time()
                await self._idle(reg, provider, max(0.0, min(renew_every(), left)))
                continue
            if action in (sm.Action.RENEW, sm.Action.RETRY_RENEW):
                # Eligibility was re-checked just above, right before this
                # submission (a retry repeats the same record).
                async with self._turn(reg):
                    await self._renew(reg, provider)
                    write = reg.records.write
                    if write is sm.WriteOutcome.ACKED:
                        await self._check(reg, provider)
                if write is sm.WriteOutcome.ACKED:
                    delay = renew_every()
                    reg.renew_at = -math.inf
                    if reg.records.attempt > 0:  # a renewal that did not apply
                        wait = renewal_retry()
                        reg.renew_at = anyio.current_time() + wait
                        delay = min(delay, wait)
                    await self._idle(reg, provider, delay)
                elif write is sm.WriteOutcome.UNKNOWN:
                    await self._idle(reg, provider, renewal_retry())
                continue
            if action is sm.Action.WAIT:
                # Ineligible: nothing is submitted (withholding the renewal
                # withholds the health publication); keep observing.
                records = reg.records
                if records.handle and records.write in (
                    sm.WriteOutcome.ACKED,
                    sm.WriteOutcome.UNKNOWN,
                ):
                    # The health publication pauses: Active again only after
                    # a renewal is acknowledged and a later check is HEALTHY.
                    self._apply(reg, sm.RenewWithheld(), anyio.current_time())
                if reg.records.write is sm.WriteOutcome.ACKED:
                    await self._check(reg, provider)
                    await self._idle(reg, provider, timing.monitor_interval, until_eligible=True)
                else:
                    delay = min(timing.monitor_interval, _ELIGIBILITY_POLL)
                    await self._idle(reg, provider, delay, until_eligible=True)
                continue
            # BLOCKED (or DONE): no write may be sent; only quiesce ends this.
            if action is sm.Action.BLOCKED:
                records = reg.records
                logger.warning(
                    "registration %r on connection %r is blocked for good: %s after %s; "
                    "nothing more is written for it until close",
                    reg.frozen.name,
                    reg.frozen.qualifier,
                    sm.derive_state(records, anyio.current_time()).value,
                    records.last_error or "an unknown outcome",
                )
            await anyio.sleep_forever()

    def _write_deadline(self, reg: _Registration, now: float) -> float:
        deadline = now + reg.frozen.timing.request_timeout
        if self._quiesce_deadline is not None:
            deadline = min(deadline, self._quiesce_deadline)
        return deadline

    async def _register(self, reg: _Registration, provider: Provider) -> bool:
        async with self._turn(reg):
            if reg.records.quiescing:
                return False  # quiesce began while this write waited for its turn
            # The write starts now: its deadline counts from here, not from
            # when the runner joined the queue.
            now = anyio.current_time()
            epoch = reg.records.epoch
            reg.sent = True
            self._apply(reg, sm.RegisterStarted(), now)
            deadline = self._write_deadline(reg, now)
            event, result = await self._write(
                reg, epoch, deadline, provider.register(reg.frozen.record, deadline), _REGISTER
            )
        acked = isinstance(event, sm.RegisterAcked)
        if acked and result is not None:
            reg.registered = result
        self._apply(reg, event, anyio.current_time())
        if not acked:
            logger.info("registration %r: register -> %s", reg.frozen.name, reg.records.last_error)
        return acked

    async def _renew(self, reg: _Registration, provider: Provider) -> None:
        registered = reg.registered
        assert registered is not None
        async with self._turn(reg):
            if reg.records.quiescing:
                return  # no renewal after quiesce, even one that was queued
            now = anyio.current_time()
            epoch = reg.records.epoch
            deadline = self._write_deadline(reg, now)
            event, result = await self._write(
                reg, epoch, deadline, provider.renew(registered, deadline), _RENEW
            )
        if result is not None:
            reg.registered = result
        self._apply(reg, event, anyio.current_time())

    async def _write(
        self,
        reg: _Registration,
        epoch: int,
        deadline: float,
        call: Coroutine[object, object, Registered],
        events: _WriteEvents,
    ) -> tuple[sm.Event, Registered | None]:
        """Run one registry write and classify its outcome as a state event.

        Shielded: a write in flight finishes (or times out) even when quiesce
        begins, so a landed registration is known and removed. Anything that
        may have reached the registry without a definite answer is "unknown",
        never "failed": the lifecycle must not write blindly after it.
        """
        result: Registered | None = None
        event: sm.Event
        # The provider bounds its own requests by ``deadline`` (a relative
        # timeout taken a moment later) and knows what a timeout of the
        # request in flight means (a lost TTL pass cannot create a record);
        # this scope is the backstop for a provider that does not bound it.
        with anyio.CancelScope(shield=True, deadline=deadline + _WRITE_BACKSTOP) as scope:
            reg.write_scope = scope
            try:
                result = await call
            except RenewalOutcomeUnknown as exc:
                event = events.unknown_refresh(_kind(exc))
            except OutcomeUnknown as exc:
                event = events.unknown(_kind(exc))
            except IdentityRevoked as exc:
                event = events.failed(_kind(exc))
                self._revoke_from(reg, epoch)
            except events.definite as exc:
                event = events.definite_event(_kind(exc))
            except ProviderFailure as exc:
                event = events.failed(_kind(exc))
            except DeadlineExceeded as exc:
                event = events.unknown(_kind(exc))
            except Exception as exc:
                logger.warning(
                    "registration %r: %s raised %s", reg.frozen.name, events.verb, _kind(exc)
                )
                event = events.unknown(_kind(exc))
            else:
                event = events.acked()
        reg.write_scope = None
        if scope.cancelled_caught:
            return events.unknown("DeadlineExceeded"), None
        return event, result

    async def _check(self, reg: _Registration, provider: Provider) -> None:
        # A check that straddled a revocation proves nothing under the new
        # epoch: ask once more at once instead of waiting for the next
        # interval (bounded: a check that itself found the identity revoked
        # does not ask again).
        for _ in range(2):
            epoch = reg.records.epoch
            revoked_here = await self._check_once(reg, provider)
            if revoked_here or reg.records.epoch == epoch or reg.records.quiescing:
                return

    async def _check_once(self, reg: _Registration, provider: Provider) -> bool:
        """One health check; True when it found the identity revoked."""
        registered = reg.registered
        if registered is None:
            return False
        async with self._turn(reg):
            # Evidence counts from when the check really started (after its turn).
            started = anyio.current_time()
            epoch = reg.records.epoch  # the check carries the epoch it started under
            timing = reg.frozen.timing
            deadline = started + timing.request_timeout
            event: sm.Event | None = None
            status: HealthStatus | None = None
            with anyio.CancelScope(deadline=deadline) as scope:
                try:
                    status = await provider.check(registered, deadline)
                except IdentityRevoked:
                    self._revoke_from(reg, epoch)
                    return True
                except InvalidSnapshot as exc:
                    event = sm.CheckInvalid(epoch, _kind(exc))
                except LeaseLost:
                    event = sm.CheckNegative(epoch, HealthStatus.MISSING)
                except (ProviderFailure, DeadlineExceeded) as exc:
                    event = sm.CheckTransient(epoch, _kind(exc))
                except Exception as exc:
                    logger.warning("registration %r: check raised %s", reg.frozen.name, _kind(exc))
                    event = sm.CheckTransient(epoch, _kind(exc))
        if scope.cancelled_caught:
            event = sm.CheckTransient(epoch, "DeadlineExceeded")
        elif event is None:
            if status is HealthStatus.HEALTHY:
                event = sm.CheckHealthy(epoch, started, timing.observation_grace)
            elif isinstance(status, HealthStatus):
                event = sm.CheckNegative(epoch, status)
            else:
                event = sm.CheckInvalid(epoch, "InvalidHealthStatus")
        self._apply(reg, event, anyio.current_time())
        return False

    def _revoke_from(self, reg: _Registration, started_epoch: int) -> None:
        """A registry call started under ``started_epoch`` answered
        IdentityRevoked. That starts a new epoch unless one already started
        since, or the current epoch is itself a revoked one with no valid
        evidence yet (the same revocation, seen again: notify once)."""
        records = reg.records
        if records.epoch != started_epoch or records.health is sm.HealthEvidence.REVOKED:
            return
        self.revoke_identity(reg.frozen.qualifier)

    # ----------------------------------------------------------- cleanup

    async def _cleanup(self, reg: _Registration, provider: Provider) -> None:
        now = anyio.current_time()
        timing = reg.frozen.timing
        quiesce_end = self._quiesce_deadline
        # Waiting for a turn under the operation bound is bounded by the
        # shutdown deadline (or, when the owner is torn down without one, by
        # a second deregister_timeout); the removal itself gets its own
        # deregister_timeout from the moment it starts.
        wait_end = quiesce_end if quiesce_end is not None else now + timing.deregister_timeout
        error: str | None = "DeadlineExceeded"
        # Shielded so the owner's cancellation cannot skip the removal, but
        # bounded by the shutdown deadline and deregister_timeout.
        with anyio.CancelScope(shield=True, deadline=wait_end) as bounded:
            if not reg.records.quiescing:
                self._apply(reg, sm.QuiesceBegan(), now)
            action = _next_action(reg)
            target = reg.registered
            if action is sm.Action.DEREGISTER and not reg.records.handle:
                # A write whose outcome is unknown (or a rejected repeat of
                # one, or a lease lost after one), on a provider that can
                # address the removal with the record alone: remove it, in
                # case it landed (its acknowledgement then reports RESIDUAL).
                target = Registered(reg.frozen.record, "")
            if action is not sm.Action.DEREGISTER or target is None:
                self._retire(reg, now)
                return
            self._apply(reg, sm.DeregisterStarted(), now)
            async with self._turn(reg):
                begun = anyio.current_time()
                budget_end = begun + timing.deregister_timeout
                if quiesce_end is not None:
                    budget_end = min(budget_end, quiesce_end)
                bounded.deadline = max(bounded.deadline, budget_end)
                if begun < budget_end:
                    with anyio.move_on_at(budget_end):
                        try:
                            await provider.deregister(target, budget_end)
                        except (ProviderFailure, DeadlineExceeded) as exc:
                            error = _kind(exc)
                        except Exception as exc:
                            logger.warning(
                                "registration %r: deregister raised %s",
                                reg.frozen.name,
                                _kind(exc),
                            )
                            error = _kind(exc)
                        else:
                            error = None
        # A removal cut off by the budget leaves ``error`` at DeadlineExceeded.
        end = anyio.current_time()
        if error is None:
            self._apply(reg, sm.DeregisterAcked(), end)
        else:
            self._apply(reg, sm.DeregisterFailed(error), end)
            logger.warning(
                "registration %r: deregistration did not complete (%s)", reg.frozen.name, error
            )


# --------------------------------------------------------------------------- owner seam


class _ConnectionLike(Protocol):
    """What the owner's connection objects offer (name, provider, policy, bindings)."""

    @property
    def provider(self) -> Provider: ...

    @property
    def policy(self) -> ConnectionConfig: ...

    @property
    def bindings(self) -> Mapping[str, str]: ...


class OwnerRegistrations:
    """Adapts a :class:`RegistrationSet` to the owner's registration seam:
    ``freeze(specs, connections)`` with the owner's connection objects,
    ``publish(task_group, deadline)``, ``begin_quiesce(deadline)``,
    ``drain(deadline)`` and ``report()``.

    ``listeners`` and ``eligibility`` resolve the specs' references when they
    were built directly rather than through :func:`resolve_registrations`.
    """

    def __init__(
        self,
        registrations: RegistrationSet | None = None,
        *,
        listeners: Mapping[str, tuple[str, int]] | None = None,
        eligibility: Mapping[str, Eligibility] | None = None,
    ) -> None:
        self.registrations = registrations if registrations is not None else RegistrationSet()
        self._listeners = listeners
        self._eligibility = eligibility
        self._providers: dict[str, Provider] = {}

    def freeze(self, specs: Sequence[object], connections: Mapping[str, _ConnectionLike]) -> None:
        plans: dict[str, ConnectionPlanLike] = {}
        providers: dict[str, Provider] = {}
        for qualifier, connection in connections.items():
            plans[qualifier] = ConnectionPlan(
                capabilities=connection.provider.capabilities,
                bindings=connection.bindings,
                timing=RegistrationTiming.from_config(connection.policy),
            )
            providers[qualifier] = connection.provider
        checked: list[RegistrationSpec] = []
        for spec in specs:
            if not isinstance(spec, RegistrationSpec):
                raise RegistrationError(
                    "?", f"expected a RegistrationSpec, got {type(spec).__name__}"
                )
            checked.append(spec)
        self.registrations.freeze(
            checked, plans, listeners=self._listeners, eligibility=self._eligibility
        )
        self._providers = providers

    def use_operations(self, limiter: anyio.CapacityLimiter) -> None:
        """The owner's ``max_parallel_operations`` bound (see
        :meth:`RegistrationSet.use_operations`)."""
        self.registrations.use_operations(limiter)

    async def publish(self, task_group: TaskSpawner, deadline: float) -> None:
        await self.registrations.publish(task_group, self._providers, deadline)

    def begin_quiesce(self, deadline: float) -> None:
        self.registrations.begin_quiesce(deadline)

    async def drain(self, deadline: float) -> None:
        """Wait for deregistration, at most until ``deadline`` (the runners'
        own cleanup is bounded by the same deadline)."""
        self.registrations.begin_quiesce(deadline)
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            await self.registrations.wait_drained()

    def report(self) -> tuple[RegistrationCloseEntry, ...]:
        return self.registrations.report()

    def eligibilities(self) -> Mapping[str, Eligibility]:
        """Registration name -> local eligibility: the live read-only view of
        :meth:`RegistrationSet.eligibilities` (filled when the plan freezes)."""
        return self.registrations.eligibilities()

    # The optional parts of the seam: identities and the readiness view.

    def revoke_identity(self, qualifier: str) -> int:
        """The connection's identity was revoked (the owner calls this when an
        observation of it sees ``IdentityRevoked``): every registration on it
        loses its health evidence; other connections are untouched. Returns
        the new identity epoch."""
        return self.registrations.revoke_identity(qualifier)

    async def identity_revoked(self, qualifier: str, *, after_epoch: int | None = None) -> int:
        """Wait for the next revocation of the connection's identity (see
        :meth:`RegistrationSet.identity_revoked`)."""
        return await self.registrations.identity_revoked(qualifier, after_epoch=after_epoch)

    def epoch(self, qualifier: str) -> int:
        """The connection's current identity epoch."""
        return self.registrations.epoch(qualifier)

    def statuses(self, now: float | None = None) -> Mapping[str, RegistrationStatus]:
        """Immutable per-registration status, judged under the current epochs."""
        return self.registrations.registrations(now)

    def ready(self, now: float | None = None) -> bool:
        """Every ``readiness_critical`` registration is Active."""
        return self.registrations.ready(now)

    async def wait_changed(self) -> None:
        """Wait until any registration's records change."""
        await self.registrations.wait_changed()
