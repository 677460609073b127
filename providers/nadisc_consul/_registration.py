"""Self-registration: the agent payload (sans-IO), contributors, and the re-apply loop.

Building the payload is pure: a :class:`~nadisc.RegistrationRecord`, the
connection settings, contributions and the host's health endpoint go in, one
JSON-ready ``dict`` comes out, or :class:`~nadisc.RegistrationError` names
what is wrong before anything is written.

Address: ``advertised_host`` wins (its settings validator already refused an
unspecified address, and a loopback one without ``allow_loopback``).
Otherwise wildcard binds (any spelling :mod:`ipaddress` reads as unspecified:
``0.0.0.0``, ``::``, ``[::0]``, ``0:0:0:0:0:0:0:0``; plus ``*`` and empty)
and loopback hosts (``localhost``, ``127.0.0.0/8``, ``::1``) are refused, because
advertising them makes the instance unreachable for everyone else; with
``allow_loopback`` (local development) wildcards are rewritten to
``localhost`` and loopback hosts are kept.

Health check, by precedence::

    RegistrationRecord.check  >  settings.health_check_path  >  host health endpoint  >  none

HTTP and TCP checks carry ``Interval``, ``Timeout`` (the interval, at most
10 s: what the agent itself uses when none is given) and
``FailuresBeforeCritical`` (``health_check_failures_before_critical``: one
slow probe does not mark the instance critical), and every check
``DeregisterCriticalServiceAfter``; TTL checks are passed on every renewal.
``CheckID`` is always ours: ``service:<instance id>``.

Tags and meta merge with ``automatic -> contributors -> user`` precedence
(later wins for a meta key); tags are unioned, keeping the first occurrence.
The library's namespace is ``nadisc-``: ``nadisc-version``, ``nadisc-cluster``
(hyphens: legal in Consul meta keys, which refuse ``.``, and DNS-safe).

:func:`run_reregistration` re-applies the held registration on an interval
(an idempotent upsert), so an instance Consul reaped after a spell of
critical health comes back by itself. It is for hosts that register without
a :class:`~nadisc.DiscoveryOwner`: under an owner the registration
lifecycle's renewals do the re-applying (``ConsulProvider.renew``), so there
is exactly one writer per registration::

    every interval:  halted?  -> stop
                     eligible? -> no: skip this round
                     reapply (PUT register, TTL pass) -> record outcome
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import anyio
from anyio.abc import TaskStatus

from nadisc import HealthCheck, ProviderFailure, Registered, RegistrationError, RegistrationRecord

from ._hosts import is_loopback_host, is_unspecified_host
from ._settings import MIN_DEREGISTER_AFTER, ConsulSettings
from ._wire import format_duration

if TYPE_CHECKING:
    from ._provider import ConsulProvider

__all__ = [
    "META_CLUSTER",
    "META_VERSION",
    "Contribution",
    "HealthEndpoint",
    "RegistrationContributor",
    "ReregistrationState",
    "advertised_address",
    "build_registration",
    "check_id_for",
    "merge_contributions",
    "run_reregistration",
]

logger = logging.getLogger(__name__)

META_VERSION = "nadisc-version"
META_CLUSTER = "nadisc-cluster"

_META_KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


@dataclass(frozen=True, slots=True)
class Contribution:
    """Additive tags and meta another component advertises on our registration."""

    tags: tuple[str, ...] = ()
    meta: Mapping[str, str] = field(default_factory=dict)


class RegistrationContributor(Protocol):
    """A component that adds tags/meta to this application's registration
    without the registration depending on it (e.g. a mesh adds its tag)."""

    def contribute(self) -> Contribution: ...


@dataclass(frozen=True, slots=True)
class HealthEndpoint:
    """The health endpoint a host exposes (the third source of a check)."""

    path: str
    scheme: str = "http"


def check_id_for(instance_id: str) -> str:
    return f"service:{instance_id}"


def advertised_address(host: str, settings: ConsulSettings, registration: str) -> str:
    """The host to advertise for ``host`` under ``settings`` (see module docs)."""
    if settings.advertised_host is not None:
        return settings.advertised_host
    token = host.strip()
    if is_unspecified_host(token):
        if settings.allow_loopback:
            return "localhost"
        raise RegistrationError(
            registration,
            f"refusing to advertise the wildcard bind {host!r}; set advertised_host "
            "(or allow_loopback for local development)",
            path="consul.advertised_host",
        )
    if is_loopback_host(token) and not settings.allow_loopback:
        raise RegistrationError(
            registration,
            f"refusing to advertise the loopback host {host!r}; set advertised_host "
            "(or allow_loopback for local development)",
            path="consul.advertised_host",
        )
    return token.strip("[]") if token.startswith("[") else token


def merge_contributions(
    automatic: tuple[Iterable[str], Mapping[str, str]],
    contributions: Sequence[Contribution],
    user: tuple[Iterable[str], Mapping[str, str]],
) -> tuple[tuple[str, ...], dict[str, str]]:
    """Merge tags and meta: automatic, then contributors in order, then user.

    Tags are unioned with ordinal de-duplication (first occurrence kept);
    a later layer's meta value replaces an earlier one for the same key.
    """
    tags: dict[str, None] = {}
    meta: dict[str, str] = {}
    layers: list[tuple[Iterable[str], Mapping[str, str]]] = [automatic]
    layers.extend((c.tags, c.meta) for c in contributions)
    layers.append(user)
    for layer_tags, layer_meta in layers:
        for tag in layer_tags:
            tags.setdefault(tag, None)
        meta.update(layer_meta)
    return tuple(tags), meta


def _effective_check(
    record: RegistrationRecord, settings: ConsulSettings, host_endpoint: HealthEndpoint | None
) -> tuple[HealthCheck | None, str]:
    if record.check is not None:
        return record.check, "http"
    if settings.health_check_path is not None:
        return (
            HealthCheck(
                kind="http",
                interval=settings.health_check_interval,
                path=settings.health_check_path,
                deregister_after=settings.deregister_critical_service_after,
            ),
            "http",
        )
    if host_endpoint is not None:
        return (
            HealthCheck(
                kind="http",
                interval=settings.health_check_interval,
                path=host_endpoint.path,
                deregister_after=settings.deregister_critical_service_after,
            ),
            host_endpoint.scheme,
        )
    return None, "http"


def build_registration(
    record: RegistrationRecord,
    settings: ConsulSettings,
    *,
    contributions: Sequence[Contribution] = (),
    host_endpoint: HealthEndpoint | None = None,
    version: str = "0",
) -> tuple[dict[str, object], str | None, str | None]:
    """The ``PUT /v1/agent/service/register`` body for ``record``.

    Returns ``(payload, check_id, check_kind)``; the last two are None when no
    check is registered. Raises :class:`RegistrationError` on a bad plan.
    """
    name = record.registration
    if not record.service:
        raise RegistrationError(name, "service name must not be empty", path="service")
    if not record.instance_id:
        raise RegistrationError(name, "instance id must not be empty", path="instance_id")
    if not 0 < record.port < 65536:
        raise RegistrationError(name, f"port {record.port} out of range 1-65535", path="port")
    if not (math.isfinite(record.weight) and record.weight >= 1):
        raise RegistrationError(
            name,
            f"weight {record.weight} must be >= 1 (Consul weights are integers)",
            path="weight",
        )
    address = advertised_address(record.host, settings, name)
    automatic_meta = {META_VERSION: version}
    if settings.cluster_id is not None:
        automatic_meta[META_CLUSTER] = settings.cluster_id
    user_meta = {**settings.meta, **record.metadata}
    tags, meta = merge_contributions(
        ((), automatic_meta), contributions, ((*settings.tags, *record.tags), user_meta)
    )
    for key, value in meta.items():
        if not _META_KEY.match(key) or key.startswith("consul-"):
            raise RegistrationError(
                name,
                f"meta key {key!r} is not accepted by Consul (letters, digits, '-', '_'; "
                "no '.'; not 'consul-')",
                path="metadata",
            )
        if len(value) > 512:
            raise RegistrationError(
                name, f"meta value of {key!r} exceeds 512 chars", path="metadata"
            )
    if len(meta) > 64:
        raise RegistrationError(name, "Consul allows at most 64 meta pairs", path="metadata")
    weight = round(record.weight)
    payload: dict[str, object] = {
        "ID": record.instance_id,
        "Name": record.service,
        "Tags": list(tags),
        "Address": address,
        "Port": record.port,
        "Meta": meta,
        "Weights": {"Passing": weight, "Warning": 1},
    }
    check, scheme = _effective_check(record, settings, host_endpoint)
    if check is None:
        return payload, None, None
    check_id = check_id_for(record.instance_id)
    host_part = f"[{address}]" if ":" in address else address
    definition: dict[str, object] = {"CheckID": check_id, "Name": f"{record.service} health"}
    deregister_after = check.deregister_after
    if deregister_after is None:
        deregister_after = settings.deregister_critical_service_after
    if deregister_after < MIN_DEREGISTER_AFTER:
        raise RegistrationError(
            name,
            f"deregister_after {deregister_after}s is below Consul's minimum of 60s",
            path="check.deregister_after",
        )
    definition["DeregisterCriticalServiceAfter"] = format_duration(deregister_after)
    if check.kind == "http":
        path = check.path or "/"
        if not path.startswith("/"):
            raise RegistrationError(name, f"check path {path!r} must start with '/'", path="check")
        definition["HTTP"] = f"{scheme}://{host_part}:{record.port}{path}"
        definition["Interval"] = format_duration(check.interval)
        definition["Timeout"] = format_duration(min(check.interval, 10.0))
        definition["FailuresBeforeCritical"] = settings.health_check_failures_before_critical
    elif check.kind == "tcp":
        definition["TCP"] = f"{host_part}:{record.port}"
        definition["Interval"] = format_duration(check.interval)
        definition["Timeout"] = format_duration(min(check.interval, 10.0))
        definition["FailuresBeforeCritical"] = settings.health_check_failures_before_critical
    elif check.kind == "ttl":
        ttl = check.ttl if check.ttl is not None else check.interval
        if not (math.isfinite(ttl) and ttl > 0):
            raise RegistrationError(name, "a TTL check needs a positive ttl", path="check.ttl")
        definition["TTL"] = format_duration(ttl)
    else:
        raise RegistrationError(
            name, f"check kind {check.kind!r} is not one of http, tcp, ttl", path="check.kind"
        )
    payload["Check"] = definition
    return payload, check_id, check.kind


@dataclass(slots=True)
class ReregistrationState:
    """What the re-apply loop did, and the flag that stops it.

    The registration lifecycle sets :meth:`halt` when the registration turned
    ``Residual`` or ``OutcomeUnknown`` (after a deregistration, say): from then
    on the loop writes nothing, so it can never resurrect a registration the
    lifecycle gave up.
    """

    writes: int = 0
    skipped_ineligible: int = 0
    failures: int = 0
    last_error: str | None = None
    halted_reason: str | None = None

    @property
    def halted(self) -> bool:
        return self.halted_reason is not None

    def halt(self, reason: str) -> None:
        if self.halted_reason is None:
            self.halted_reason = reason


async def run_reregistration(
    provider: ConsulProvider,
    registered: Registered,
    interval: float,
    eligible: Callable[[], bool],
    *,
    state: ReregistrationState | None = None,
    request_timeout: float = 10.0,
    task_status: TaskStatus[ReregistrationState] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Re-apply ``registered`` every ``interval`` seconds until cancelled or halted.

    Eligibility is re-checked right before every write. Failures are recorded
    in the state and retried at the next tick (the write is idempotent).
    Reports the :class:`ReregistrationState` through ``task_status``.
    """
    if not (math.isfinite(interval) and interval > 0):
        raise ValueError("interval must be finite and > 0")
    state = state if state is not None else ReregistrationState()
    task_status.started(state)
    next_at = anyio.current_time() + interval
    while True:
        await anyio.sleep_until(next_at)
        next_at += interval
        now = anyio.current_time()
        if next_at <= now:  # we fell behind: do not burst to catch up
            next_at = now + interval
        if state.halted:
            logger.info(
                "re-registration of %s stopped: %s",
                registered.record.instance_id,
                state.halted_reason,
            )
            return
        if not eligible():
            state.skipped_ineligible += 1
            continue
        try:
            await provider.reapply(registered, anyio.current_time() + request_timeout)
        except ProviderFailure as exc:
            state.failures += 1
            state.last_error = str(exc)
            logger.warning("re-registration of %s failed: %s", registered.record.instance_id, exc)
        else:
            state.writes += 1
