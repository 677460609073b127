"""Sans-IO evidence of one Service: the Service object, its slices, the listing.

Contract: synchronous, no I/O, no clock. :class:`ServiceView` holds what
the two streams (Service and EndpointSlices) established and turns it into
a complete :class:`~nadisc.ProviderSnapshot` with :func:`build_snapshot`::

    Service absent (404 / DELETED)              -> explicit empty listing
    Service of type ExternalName                -> InvalidSnapshot (a DNS alias, no endpoints)
    Service present, port not on the Service    -> InvalidSnapshot (misconfigured)
    which labelled slices are the Service's (the rest is counted in ``invalid``):
      Service with a selector     owned by Service/<name> with the current UID
      Service without a selector  owned by Endpoints/<name> (mirrored by the
                                  EndpointSlice mirroring controller), or - only
                                  with ``trust_unowned_slices`` - owned by nothing
    slice of another address family than ``ip_family`` -> skipped (not invalid)
    owned slice without the port's name         -> counted in ``invalid``
    endpoint  terminating? ── no ─► ready (nil = true)?   yes: served
                  │                                     no: withdrawn
                  └─ yes ─► serving (nil = ready)?      yes: draining
                                                        no: withdrawn

An endpoint's identity is its ``targetRef`` (the Pod's UID, else
``<kind>/<namespace>/<name>``), never its IP; only an endpoint without a
``targetRef`` falls back to ``<addressType>/<first address>:<port>`` (so
two ports of one host are two members). The same identity in several
slices (a slice being split or merged, or both families of a dual-stack
Pod when no family is chosen) is one member: a served copy beats a
draining one, then IPv4 beats IPv6, then the slice that sorts first - the
same answer whatever order the slices arrived in. Zone, node name,
hostname, zone hints, the address type and the port's ``appProtocol`` are
kept in the metadata (one shared mapping per distinct content).

Cost: O(endpoints) dictionary work per snapshot; :class:`ServiceView` keeps
the last one until something changes, and the instances of every slice that
did not change (a watch event on one slice of forty builds that slice's
instances only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from types import MappingProxyType

from nadisc import (
    CapacityRejected,
    EvidenceKind,
    Instance,
    InvalidSnapshot,
    ProviderSnapshot,
)
from nadisc._instance import _trusted_instances, trusted_instance, valid_hosts

from ._wire import EndpointSlice, Event, Service, SliceEndpoint

__all__ = ["SERVICE_NAME_LABEL", "ServiceView", "build_snapshot", "endpoint_state"]

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def endpoint_state(endpoint: SliceEndpoint) -> str:
    """``served``, ``draining`` or ``withdrawn`` (the table in the module docstring)."""
    conditions = endpoint.conditions
    ready = conditions.ready is not False
    if conditions.terminating:
        serving = conditions.serving if conditions.serving is not None else ready
        return "draining" if serving else "withdrawn"
    return "served" if ready else "withdrawn"


def _identity(slice_: EndpointSlice, endpoint: SliceEndpoint, port: int) -> str:
    ref = endpoint.targetRef
    if ref is not None and ref.uid:
        return ref.uid
    if ref is not None and ref.name:
        namespace = ref.namespace or slice_.metadata.namespace
        return f"{ref.kind or 'Pod'}/{namespace}/{ref.name}"
    address = endpoint.addresses[0]
    host = f"[{address}]" if ":" in address else address
    return f"{slice_.addressType}/{host}:{port}"


#: Address families by the ``ip_family`` setting's spelling.
FAMILIES = {"ipv4": "IPv4", "ipv6": "IPv6"}
_FAMILY_RANK = {"IPv4": 0, "IPv6": 1}


def chosen_family(service: Service, ip_family: str) -> str | None:
    """The address type served: ``ipv4``/``ipv6`` as set; ``primary``: the
    Service's first ``spec.ipFamilies`` entry (None when it has none: every
    family, merged by identity)."""
    if ip_family in FAMILIES:
        return FAMILIES[ip_family]
    families = service.spec.ipFamilies
    return families[0] if families else None


def slice_owner(slice_: EndpointSlice, service: Service, *, trust_unowned: bool) -> str | None:
    """None when ``slice_`` is evidence for ``service``, else why not.

    Kubernetes writes a Service's slices in two ways: the EndpointSlice
    controller for a Service with a selector (owner: the Service, by UID),
    and the mirroring controller for a Service without one that has an
    Endpoints object of the same name (owner: ``Endpoints/<name>``;
    pkg/controller/endpointslicemirroring/utils.go). A slice that only
    carries the service-name label is someone's claim, trusted only when
    the connection says so (``trust_unowned_slices``), and only for a
    Service without a selector (with one, the controller owns the slices).
    """
    meta = service.metadata
    owners = slice_.metadata.ownerReferences
    if any(o.kind == "Service" and o.uid == meta.uid for o in owners):
        return None
    if not service.spec.selector:
        if any(o.kind == "Endpoints" and o.name == meta.name for o in owners):
            return None
        if not owners:
            if trust_unowned:
                return None
            return (
                "owned by nothing (a hand-written slice of a Service without a selector; "
                "served only with trust_unowned_slices)"
            )
    owned = ", ".join(f"{o.kind}/{o.name} uid {o.uid}" for o in owners) or "nothing"
    expected = (
        f"the current Service (uid {meta.uid})"
        if service.spec.selector
        else f"the current Service (uid {meta.uid}) or Endpoints/{meta.name}"
    )
    return f"not owned by {expected}; owned by {owned}"


_NO_METADATA: Mapping[str, str] = MappingProxyType({})


class _Metadata:
    """Builds instance metadata, sharing one read-only mapping per distinct
    content (endpoints on one node in one zone share theirs)."""

    __slots__ = ("plain", "shared")

    def __init__(self) -> None:
        #: Content key (see :meth:`of`) -> its one mapping.
        self.shared: dict[tuple[str, ...], Mapping[str, str]] = {}
        #: (address type, app protocol) -> (zone, node, hostname) as the
        #: endpoint has them -> the mapping :meth:`of` gives an endpoint
        #: without hints (the column pass's look-up).
        self.plain: dict[
            tuple[str, str], dict[tuple[str | None, str | None, str | None], Mapping[str, str]]
        ] = {}

    def of(
        self, slice_: EndpointSlice, endpoint: SliceEndpoint, app_protocol: str | None
    ) -> Mapping[str, str]:
        # The key is the content itself, built without a list; the mapping
        # only on the first endpoint with that content (most share one).
        hints = endpoint.hints
        zones = ",".join(z.name for z in hints.forZones) if hints and hints.forZones else ""
        key = (
            slice_.addressType,
            endpoint.zone or "",
            endpoint.nodeName or "",
            endpoint.hostname or "",
            zones,
            app_protocol or "",
        )
        shared = self.shared.get(key)
        if shared is None:
            names = ("address_type", "zone", "node_name", "hostname", "hints.for_zones")
            items = {name: value for name, value in zip(names, key, strict=False) if value}
            items["address_type"] = slice_.addressType
            if app_protocol:
                items["app_protocol"] = app_protocol
            shared = self.shared[key] = MappingProxyType(items)
        return shared


@dataclass(frozen=True, slots=True)
class _SliceResult:
    """What one slice contributes: its members as three columns (identity,
    rank, instance; a rank of one member is a lower number when it is to be
    preferred) and its invalid records."""

    identities: tuple[str, ...]
    ranks: tuple[int, ...]
    instances: tuple[Instance, ...]
    invalid: tuple[tuple[str, str], ...]


def _refused(*invalid: tuple[str, str]) -> _SliceResult:
    """A slice that contributes no member."""
    return _SliceResult((), (), (), invalid)


#: What a cached slice result depends on besides the slice itself: Service
#: name, UID, whether it has a selector, the port name, the family, the trust.
_CacheKey = tuple[str, str, bool, str, str | None, bool]
#: Per slice name: (the slice object, the key it was built for, its result).
SliceCache = dict[str, tuple[EndpointSlice, _CacheKey, _SliceResult]]


def _slice_result(
    slice_: EndpointSlice,
    service: Service,
    port_name: str,
    metadata: _Metadata,
    *,
    family: str | None = None,
    trust_unowned: bool = False,
) -> _SliceResult:
    meta = service.metadata
    key = f"endpointslice/{slice_.metadata.name}"
    if slice_.metadata.labels.get(SERVICE_NAME_LABEL) != meta.name:
        return _refused((key, f"not labelled {SERVICE_NAME_LABEL}={meta.name}"))
    refused = slice_owner(slice_, service, trust_unowned=trust_unowned)
    if refused is not None:
        return _refused((key, refused))
    if family is not None and slice_.addressType != family:
        return _refused()  # the other family of a dual-stack Service
    slice_port = next((p for p in slice_.ports or () if (p.name or "") == port_name), None)
    if slice_port is None:
        if slice_.endpoints:
            return _refused((key, f"has no port named {port_name!r}"))
        return _refused()
    number = slice_port.port
    if number is None or not 0 < number < 65536:
        return _refused((key, f"port {port_name!r} has no usable number"))
    address_type = slice_.addressType
    family_rank = _FAMILY_RANK.get(address_type, 2)
    app_protocol = slice_port.appProtocol
    app = app_protocol or ""
    endpoints = slice_.endpoints or ()
    plain = _plain_members(endpoints, slice_, number, family_rank, app_protocol, metadata)
    if plain is not None:
        return plain
    members: list[tuple[str, int, Instance]] = []
    invalid: list[tuple[str, str]] = []
    # _Metadata.of for the common case (no hints, so no zones), inline: the
    # same key it builds, so both find the same shared mapping.
    shared_metadata = metadata.shared.get
    for position, endpoint in enumerate(endpoints):
        # endpoint_state, its common case (not terminating) inline.
        conditions = endpoint.conditions
        if not conditions.terminating:
            if conditions.ready is False:
                continue
            draining = False
        else:
            state = endpoint_state(endpoint)
            if state == "withdrawn":
                continue
            draining = state == "draining"
        addresses = endpoint.addresses
        if not addresses or not addresses[0]:
            invalid.append((f"{key}/{position}", "endpoint without an address"))
            continue
        ref = endpoint.targetRef
        identity = ref.uid if ref is not None and ref.uid else _identity(slice_, endpoint, number)
        md = (
            None
            if endpoint.hints is not None
            else shared_metadata(
                (
                    address_type,
                    endpoint.zone or "",
                    endpoint.nodeName or "",
                    endpoint.hostname or "",
                    "",
                    app,
                )
            )
        )
        if md is None:
            md = metadata.of(slice_, endpoint, app_protocol)
        try:
            # Identity (a uid or built from parts) and port (checked above)
            # are what the constructor would check: only the host is.
            instance = trusted_instance(identity, addresses[0], number, 1.0, md, (), draining)
        except ValueError as exc:
            invalid.append((f"{key}/{position}", str(exc)))
            continue
        members.append((identity, (4 if draining else 0) + family_rank, instance))
    identities, ranks, instances = zip(*members, strict=True) if members else ((), (), ())
    return _SliceResult(identities, ranks, instances, tuple(invalid))


def _plain_members(
    endpoints: Sequence[SliceEndpoint],
    slice_: EndpointSlice,
    number: int,
    rank: int,
    app_protocol: str | None,
    metadata: _Metadata,
) -> _SliceResult | None:
    """The members of a slice whose every endpoint is the common case, in
    column passes (each a comprehension or a C call over the whole slice)
    instead of one Python iteration per endpoint: served (not terminating,
    not unready), an address, a ``targetRef`` with a UID, no hints, a host
    valid or already known valid. None when any endpoint
    is not: the per-endpoint loop then decides each one (and names what is
    wrong), with the same result for the endpoints both paths take."""
    count = len(endpoints)
    if not count:
        return _refused()
    try:
        identities = [e.targetRef.uid for e in endpoints]  # type: ignore[union-attr]
        hosts = [e.addresses[0] for e in endpoints]
    except (AttributeError, IndexError):
        return None  # no targetRef, or no address: the loop decides
    if "" in identities or "" in hosts:
        return None
    odd = [
        e
        for e in endpoints
        if e.hints is not None or e.conditions.terminating or e.conditions.ready is False
    ]
    if odd:
        return None  # hints, terminating or not ready: the loop decides
    if not valid_hosts(hosts):
        return None
    # The shared metadata by (zone, node, hostname), as _Metadata.of builds
    # it for an endpoint without hints of this slice's type and protocol.
    table = metadata.plain.setdefault((slice_.addressType, app_protocol or ""), {})
    places = list(
        zip(
            [e.zone for e in endpoints],
            [e.nodeName for e in endpoints],
            [e.hostname for e in endpoints],
            strict=True,
        )
    )
    mappings = list(map(table.get, places))
    if None in mappings:
        for position, endpoint in enumerate(endpoints):
            if mappings[position] is None:
                found = table[places[position]] = metadata.of(slice_, endpoint, app_protocol)
                mappings[position] = found
    instances = _trusted_instances(identities, hosts, repeat(number), repeat(1.0), mappings)  # type: ignore[arg-type]
    return _SliceResult(tuple(identities), (rank,) * count, tuple(instances), ())


def _merged(results: list[_SliceResult]) -> dict[str, Instance]:
    """Identity -> the instance served for it, over the slices' results in
    the order of their names: when an identity is listed more than once,
    served before draining, then IPv4, then the slice that sorts first."""
    identities: list[str] = []
    instances: list[Instance] = []
    for result in results:
        identities += result.identities
        instances += result.instances
    chosen = dict(zip(identities, instances, strict=True))
    if len(chosen) == len(identities):
        return chosen  # every identity listed once (the usual case): nothing to rank
    chosen.clear()
    rank_of: dict[str, int] = {}
    for result in results:
        for identity, rank, instance in zip(
            result.identities, result.ranks, result.instances, strict=True
        ):
            known = rank_of.get(identity)
            if known is not None and known <= rank:
                continue
            rank_of[identity] = rank
            chosen[identity] = instance
    return chosen


def build_snapshot(
    alias: str,
    service: Service | None,
    slices: Iterable[EndpointSlice],
    *,
    port: str | int | None,
    max_instances: int,
    cache: SliceCache | None = None,
    protocol: str | None = None,
    ip_family: str = "primary",
    trust_unowned: bool = False,
) -> ProviderSnapshot:
    """The listing of ``alias`` from the Service and its labelled slices.

    With ``cache`` (kept by the caller between calls), a slice that is the
    very same object as last time, for the same Service UID and port, reuses
    its instances: a watch event on one slice rebuilds only that slice.
    """
    evidence = EvidenceKind.ORCHESTRATOR_READY
    if service is None:
        return ProviderSnapshot(alias, (), evidence)
    meta = service.metadata
    ports = service.spec.ports
    where = f"Service {meta.namespace}/{meta.name}"
    if service.spec.type == "ExternalName":
        raise InvalidSnapshot(
            f"{where} is of type ExternalName (a DNS alias for "
            f"{service.spec.externalName or 'an external name'!r}): it has no endpoints to "
            "list; resolve that name with a dns connection instead"
        )
    if port is None:
        if len(ports) != 1:
            raise InvalidSnapshot(
                f"{where} has {len(ports)} ports; name the one to call with services.<alias>.port"
            )
        chosen = ports[0]
    else:
        found = [p for p in ports if (p.name == port if isinstance(port, str) else p.port == port)]
        if protocol is not None:
            found = [p for p in found if p.protocol == protocol]
        elif len(found) > 1:
            # One number on several protocols (DNS: 53/UDP and 53/TCP): TCP
            # unless the binding names the protocol.
            tcp = [p for p in found if p.protocol == "TCP"]
            if not tcp:
                protocols = ", ".join(p.protocol for p in found)
                raise InvalidSnapshot(
                    f"{where} has port {port} on several protocols ({protocols}); name one "
                    "with services.<alias>.protocol"
                )
            found = tcp
        if not found:
            listed = ", ".join(f"{p.name or p.port}/{p.protocol}" for p in ports) or "none"
            wanted = f"{port}/{protocol}" if protocol is not None else repr(port)
            raise InvalidSnapshot(f"{where} has no port {wanted} (its ports: {listed})")
        chosen = found[0]
    port_name = chosen.name
    family = chosen_family(service, ip_family)
    families = service.spec.ipFamilies
    if family is not None and families and family not in families:
        raise InvalidSnapshot(
            f"{where} has no {family} addresses (spec.ipFamilies: {', '.join(families)}); "
            f"ip_family: {ip_family} cannot be served"
        )
    key_of: _CacheKey = (
        meta.name,
        meta.uid,
        bool(service.spec.selector),
        port_name,
        family,
        trust_unowned,
    )
    invalid: dict[str, str] = {}
    results: list[_SliceResult] = []
    metadata = _Metadata()
    for slice_ in sorted(slices, key=lambda s: s.metadata.name):
        name = slice_.metadata.name
        cached = cache.get(name) if cache is not None else None
        if cached is not None and cached[0] is slice_ and cached[1] == key_of:
            result = cached[2]
        else:
            result = _slice_result(
                slice_,
                service,
                port_name,
                metadata,
                family=family,
                trust_unowned=trust_unowned,
            )
            if cache is not None:
                cache[name] = (slice_, key_of, result)
        invalid.update(result.invalid)
        results.append(result)
    served = _merged(results)
    if len(served) > max_instances:
        raise CapacityRejected(
            f"{where}: more than max_instances_per_service={max_instances} endpoints"
        )
    instances = tuple([served[identity] for identity in sorted(served)])
    # Identities are unique (the keys of ``served``) and every host was
    # checked when its instance was built: no per-instance pass again.
    return ProviderSnapshot._assembled(alias, instances, evidence, invalid, -1)


@dataclass(slots=True)
class _Side:
    """One stream's established state."""

    synced: bool = False
    version: str = ""


class ServiceView:
    """What the two streams of one Service know; see the module docstring."""

    def __init__(
        self,
        alias: str,
        name: str,
        *,
        port: str | int | None,
        max_instances: int,
        protocol: str | None = None,
        ip_family: str = "primary",
        trust_unowned: bool = False,
    ) -> None:
        self.alias = alias
        self.name = name
        self.port = port
        self.max_instances = max_instances
        self.protocol = protocol
        self.ip_family = ip_family
        self.trust_unowned = trust_unowned
        self.service: Service | None = None
        self.slices: dict[str, EndpointSlice] = {}
        self.sides = {"service": _Side(), "slice": _Side()}
        #: Grows with every change applied (a change counter, not a version).
        self.changes = 0
        self._cached: tuple[int, ProviderSnapshot] | None = None
        self._slice_cache: SliceCache = {}

    @property
    def synced(self) -> bool:
        return all(side.synced for side in self.sides.values())

    def version(self, kind: str) -> str:
        return self.sides[kind].version

    def unsync(self, kind: str) -> None:
        """The stream of ``kind`` lost its place (a 410): its state is unknown."""
        self.sides[kind].synced = False

    def reset_service(self, items: Iterable[Service], version: str) -> None:
        matching = [s for s in items if s.metadata.name == self.name]
        new = matching[0] if matching else None
        if new != self.service:
            self.service = new
            self.changes += 1
        self.sides["service"] = _Side(True, version)

    def reset_slices(self, items: Iterable[EndpointSlice], version: str) -> None:
        new = {s.metadata.name: s for s in items}
        if new != self.slices:
            self.slices = new
            self.changes += 1
        self.sides["slice"] = _Side(True, version)

    def apply(self, kind: str, event: Event) -> bool:
        """Apply one ADDED/MODIFIED/DELETED/BOOKMARK event; True when it changed state."""
        side = self.sides[kind]
        if event.resource_version:
            side.version = event.resource_version
        obj = event.object
        if obj is None:
            return False
        name = obj.metadata.name
        if kind == "service":
            if name != self.name:
                return False
            new = None if event.type == "DELETED" else obj
            if new == self.service:
                return False
            self.service = new if isinstance(new, Service) else None
        else:
            assert isinstance(obj, EndpointSlice)
            if event.type == "DELETED":
                if self.slices.pop(name, None) is None:
                    return False
            else:
                if self.slices.get(name) == obj:
                    return False
                self.slices[name] = obj
        self.changes += 1
        return True

    def snapshot(self) -> ProviderSnapshot:
        cached = self._cached
        if cached is not None and cached[0] == self.changes:
            return cached[1]
        cache = self._slice_cache
        for gone in [name for name in cache if name not in self.slices]:
            del cache[gone]
        snapshot = build_snapshot(
            self.alias,
            self.service,
            self.slices.values(),
            port=self.port,
            max_instances=self.max_instances,
            cache=cache,
            protocol=self.protocol,
            ip_family=self.ip_family,
            trust_unowned=self.trust_unowned,
        )
        self._cached = (self.changes, snapshot)
        return snapshot
