"""The built-in ``dns`` provider: discovery from A/AAAA or SRV records.

DNS proves only that an address is published: every snapshot is marked
:attr:`~nadisc.EvidenceKind.ADDRESS_ONLY`, never health. The provider cannot
register and holds no watch streams; the runtime polls :meth:`DnsProvider.query`.

Outcomes of one query::

    answer with records          -> complete snapshot (sorted, stable order)
    NXDOMAIN / NOERROR no data   -> complete EMPTY snapshot (explicit empty,
                                    the runtime applies no grace)
    SRV with the single target . -> complete EMPTY snapshot (RFC 2782: the
                                    service is decidedly not available)
    timeout, SERVFAIL, REFUSED,  -> IncompleteSnapshot (grace may apply)
    no usable nameserver
    more instances than allowed  -> CapacityRejected
    deadline already past        -> DeadlineExceeded (nothing is sent)

Address mode (``{host, port}``) asks for A and AAAA concurrently (inside the
call, in a task group that ends with it) and pairs every address with the
configured port; identities are ``address:port`` (``[v6]:port``). SRV mode
(``{host: _svc._proto.name, srv: true}``) follows RFC 2782's priorities: only
the lowest-numbered priority that has at least one usable target is
published; higher numbers are fallbacks, published only when no
lower-priority target in the answer can be an instance (records that cannot
are reported in ``invalid``). Inside the published priority there is one
instance per target, identity ``target:port``, heaviest weight first. The
RFC's weighted random pick is left to the balancer (the weight is carried
into ``Instance.weight``; weight 0 becomes :data:`SRV_ZERO_WEIGHT`, "a very
small chance"); a stable order keeps unchanged DNS data from looking like a
change. DNS cannot tell whether a target is up, so a priority is never
skipped because its targets fail: that is the caller's retry policy.

TTL: after every complete answer the provider remembers when the answer
expires (``answer.expiration``, wall clock). :meth:`DnsProvider.next_refresh`
returns the seconds left, floored at ``min_refresh_ms``; a poller should wait
``min(poll_interval, next_refresh(alias))`` before the next query
(:meth:`DnsProvider.refresh_delay` computes exactly that).

Cost: one or two UDP (or TCP) round trips per query, no cache of its own.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import dns.asyncbackend
import dns.asyncresolver
import dns.exception
import dns.message
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from .._config import DnsConfig, DnsServiceConfig
from .._deadlines import time_left
from .._errors import (
    CapacityRejected,
    IncompleteSnapshot,
    LifecycleError,
    UnknownService,
)
from .._instance import EvidenceKind, Instance, ProviderSnapshot
from .._provider import (
    Capabilities,
    ConnectionContext,
    DiscoveryOnlyProvider,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["SRV_ZERO_WEIGHT", "DnsProvider", "factory"]

logger = logging.getLogger(__name__)

#: ``Instance.weight`` for an SRV record of weight 0 (instances need weight > 0).
SRV_ZERO_WEIGHT = 0.01

_CAPABILITIES = Capabilities(evidence=EvidenceKind.ADDRESS_ONLY)


@dataclass(frozen=True, slots=True)
class _Records:
    """One record type's outcome: rdata (maybe none) and its wall-clock expiry."""

    rdata: tuple[Any, ...]
    expiration: float | None


ResolverFactory = Callable[[DnsConfig], dns.asyncresolver.Resolver]


def _default_resolver(settings: DnsConfig) -> dns.asyncresolver.Resolver:
    addresses = settings.nameserver_addresses()
    if addresses is None:
        resolver = dns.asyncresolver.Resolver(configure=True)
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver(ip, port) for ip, port in addresses]
    resolver.cache = None  # the runtime keeps evidence; answers must be fresh
    resolver.retry_servfail = False
    return resolver


class DnsProvider(DiscoveryOnlyProvider):
    """Discovery over DNS for one named connection. See the module docstring."""

    provider_name = "dns"

    def __init__(
        self,
        context: ConnectionContext,
        settings: DnsConfig,
        *,
        resolver_factory: ResolverFactory = _default_resolver,
    ) -> None:
        self._context = context
        self._settings = settings
        self._resolver_factory = resolver_factory
        self._resolver: dns.asyncresolver.Resolver | None = None
        self._expiry: dict[str, float] = {}
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<DnsProvider connection={self._context.name!r} "
            f"services={len(self._settings.services)} closed={self._closed}>"
        )

    @property
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    @property
    def settings(self) -> DnsConfig:
        return self._settings

    # ----------------------------------------------------------------- lifecycle

    async def prepare(self, deadline: float) -> None:
        """Build the resolver; DNS has no session to check, nothing is sent."""
        self._check_open()
        time_left(deadline)
        self._get_resolver()
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self._closed = True
        self._resolver = None
        self._expiry.clear()

    # ----------------------------------------------------------------- discovery

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        """One complete listing of ``service`` (an alias of the ``dns`` block)."""
        self._check_open()
        spec = self._settings.services.get(service)
        if spec is None:
            raise UnknownService(
                f"service {service!r} is not bound on connection {self._context.name!r}"
            )
        budget = min(time_left(deadline), self._context.request_timeout)
        resolver = self._get_resolver()
        types = ("SRV",) if spec.srv else spec.address_types
        outcomes: dict[str, _Records | BaseException] = {}

        async def one(rdtype: str) -> None:
            outcomes[rdtype] = await self._resolve(resolver, spec.host, rdtype, budget)

        with anyio.move_on_after(budget) as scope:
            async with anyio.create_task_group() as tg:
                for rdtype in types:
                    tg.start_soon(one, rdtype)
        if scope.cancelled_caught:
            raise IncompleteSnapshot(
                f"dns: {service!r} ({spec.host}) not answered within {budget:.3f} s"
            )
        records: dict[str, _Records] = {}
        for rdtype in types:
            outcome = outcomes[rdtype]
            if isinstance(outcome, BaseException):
                raise IncompleteSnapshot(
                    f"dns: {rdtype} query for {service!r} ({spec.host}) failed: "
                    f"{_describe(outcome)}"
                ) from outcome
            records[rdtype] = outcome
        if spec.srv:
            snapshot = self._srv_snapshot(service, records["SRV"])
        else:
            snapshot = self._address_snapshot(service, spec, records)
        expirations = [r.expiration for r in records.values() if r.expiration is not None]
        if expirations:
            self._expiry[service] = min(expirations)
        else:
            self._expiry.pop(service, None)
        return snapshot

    def next_refresh(self, service: str) -> float | None:
        """Seconds until the last complete answer for ``service`` expires (its
        TTL), at least ``min_refresh_ms``; ``None`` before any answer or when
        the answer carried no TTL."""
        expiration = self._expiry.get(service)
        if expiration is None:
            return None
        floor = self._settings.min_refresh_ms / 1000
        return max(expiration - time.time(), floor)

    def refresh_delay(self, service: str, poll_interval: float) -> float:
        """How long a poller waits before the next query: ``min(poll_interval,
        next_refresh(service))``."""
        ttl = self.next_refresh(service)
        return poll_interval if ttl is None else min(poll_interval, ttl)

    # ----------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError(f"dns provider for {self._context.name!r} is closed")

    def _get_resolver(self) -> dns.asyncresolver.Resolver:
        if self._resolver is None:
            try:
                self._resolver = self._resolver_factory(self._settings)
            except dns.resolver.NoResolverConfiguration as exc:
                raise IncompleteSnapshot("dns: no nameservers are configured") from exc
            if not self._resolver.nameservers:
                self._resolver = None
                raise IncompleteSnapshot("dns: no nameservers are configured")
        return self._resolver

    async def _resolve(
        self, resolver: dns.asyncresolver.Resolver, host: str, rdtype: str, budget: float
    ) -> _Records | BaseException:
        try:
            qname = dns.name.from_text(host)
        except dns.exception.DNSException as exc:
            return exc
        # dnspython remembers the first event loop it saw as its default
        # backend; name the running one so trio and asyncio can share a process.
        backend = dns.asyncbackend.get_backend(dns.asyncbackend.sniff())
        try:
            answer = await resolver.resolve(
                qname,
                rdtype,
                tcp=self._settings.tcp,
                lifetime=budget,
                search=False,
                raise_on_no_answer=False,
                backend=backend,
            )
        except dns.resolver.NXDOMAIN as exc:
            return _Records((), _negative_expiration(exc, qname))
        except dns.exception.DNSException as exc:
            return exc
        except OSError as exc:
            return exc
        if answer.rrset is None:
            return _Records((), answer.expiration)
        return _Records(tuple(answer.rrset), answer.expiration)

    def _check_capacity(self, service: str, count: int) -> None:
        limit = self._context.max_instances_per_service
        if count > limit:
            raise CapacityRejected(
                f"dns: {service!r} has {count} records, more than "
                f"max_instances_per_service ({limit})"
            )

    def _address_snapshot(
        self, service: str, spec: DnsServiceConfig, records: dict[str, _Records]
    ) -> ProviderSnapshot:
        assert spec.port is not None
        addresses: list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]] = []
        for rdtype in spec.address_types:
            found = {ipaddress.ip_address(r.address) for r in records[rdtype].rdata}
            addresses.extend((rdtype, a) for a in sorted(found, key=lambda a: a.packed))
        self._check_capacity(service, len(addresses))
        instances = []
        for record_type, address in addresses:
            host = str(address)
            identity = f"[{host}]:{spec.port}" if address.version == 6 else f"{host}:{spec.port}"
            instances.append(
                Instance(
                    identity=identity,
                    host=host,
                    port=spec.port,
                    metadata={"dns.record": record_type},
                )
            )
        return ProviderSnapshot(
            service=service, instances=tuple(instances), evidence=EvidenceKind.ADDRESS_ONLY
        )

    def _srv_snapshot(self, service: str, records: _Records) -> ProviderSnapshot:
        rdata = records.rdata
        if len(rdata) == 1 and rdata[0].target == dns.name.root:
            logger.debug("dns: %s: SRV target '.' (service decidedly unavailable)", service)
        groups: dict[int, list[Any]] = {}
        for record in rdata:
            if record.target != dns.name.root:
                groups.setdefault(record.priority, []).append(record)
        invalid: dict[str, str] = {}
        # RFC 2782: a client must try the lowest-numbered priority it can
        # reach; higher numbers are fallbacks. Publish only the best group
        # that has a usable target, so a weighted balancer never spreads
        # traffic onto backups.
        for priority in sorted(groups):
            instances = self._srv_group(groups[priority], invalid)
            if instances:
                self._check_capacity(service, len(instances))
                return ProviderSnapshot(
                    service=service,
                    instances=instances,
                    evidence=EvidenceKind.ADDRESS_ONLY,
                    invalid=invalid,
                )
        return ProviderSnapshot(
            service=service, instances=(), evidence=EvidenceKind.ADDRESS_ONLY, invalid=invalid
        )

    @staticmethod
    def _srv_group(group: list[Any], invalid: dict[str, str]) -> tuple[Instance, ...]:
        """The instances of one priority's records, heaviest weight first;
        records that cannot be instances go to ``invalid``."""
        ordered = sorted(group, key=lambda r: (-r.weight, r.target.to_text(), r.port))
        instances: list[Instance] = []
        seen: set[str] = set()
        for record in ordered:
            target = record.target.to_text(omit_final_dot=True)
            identity = f"{target}:{record.port}"
            if identity in seen:
                continue  # the same target again with a lighter weight
            seen.add(identity)
            try:
                instance = Instance(
                    identity=identity,
                    host=target,
                    port=record.port,
                    weight=float(record.weight) if record.weight > 0 else SRV_ZERO_WEIGHT,
                    metadata={
                        "dns.record": "SRV",
                        "dns.srv.priority": str(record.priority),
                        "dns.srv.weight": str(record.weight),
                    },
                )
            except ValueError as exc:
                invalid[identity] = str(exc)
                continue
            instances.append(instance)
        return tuple(instances)


def _negative_expiration(exc: dns.resolver.NXDOMAIN, qname: dns.name.Name) -> float | None:
    """Expiry of an NXDOMAIN answer from its SOA (RFC 2308), when present."""
    try:
        response = exc.response(qname)  # type: ignore[no-untyped-call]
    except (KeyError, dns.exception.DNSException):
        return None
    if not isinstance(response, dns.message.Message):
        return None
    for rrset in response.authority:
        if rrset.rdtype == dns.rdatatype.SOA and len(rrset):
            return time.time() + float(min(rrset.ttl, rrset[0].minimum))
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, dns.resolver.LifetimeTimeout):
        return "timed out"
    if isinstance(exc, dns.resolver.NoNameservers):
        return "no nameserver gave a usable answer (SERVFAIL, REFUSED or unreachable)"
    if isinstance(exc, dns.exception.Timeout):
        return "timed out"
    return type(exc).__name__


class _DnsFactory:
    """The ``dns`` entry of the ``nadisc.providers`` entry-point group."""

    @property
    def name(self) -> str:
        return "dns"

    @property
    def settings_model(self) -> type[BaseModel]:
        return DnsConfig

    def create(self, context: ConnectionContext, settings: BaseModel) -> DnsProvider:
        if not isinstance(settings, DnsConfig):
            raise TypeError(f"dns settings must be DnsConfig, not {type(settings).__name__}")
        return DnsProvider(context, settings)

    def __repr__(self) -> str:
        return "<ProviderFactory dns>"


#: What the ``nadisc.providers`` entry point ``dns`` names.
factory = _DnsFactory()
