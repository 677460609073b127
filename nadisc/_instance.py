"""Discovered instances and the complete listings providers hand to observations.

An :class:`Instance` keeps the provider's own instance identity: two instances
with one address but different identities are different members, and a
rebuild decision never relies on the address alone.

*Draining.* An instance with ``draining=True`` is still listed (its calls in
flight may finish) but takes no new calls: the calling route marks it
draining in its poise ``Directory`` (``Directory.drain``: same allocation, so
the calls in flight keep their load guards) and declines any new attempt on
it; :class:`~nadisc.FirstServing` never probes it. Providers set it when the
registry says an instance is shutting down but still serving (a Kubernetes
endpoint that is ``serving`` and ``terminating``). A listing whose instances
are all draining is not an explicit empty one.

Costs: building a :class:`ProviderSnapshot` checks identities and, on first
use, measures its bytes, O(n) Python work each. A provider that follows a
stream of changes keeps an :class:`IncrementalListing` instead: it maintains
key order, the identity count and the byte total per change
(O(log n) comparisons each, plus a pointer move for the sorted insert), and
its :meth:`~IncrementalListing.snapshot` copies one tuple of references
(O(n) in C) and does no per-instance Python work.
"""

from __future__ import annotations

import bisect
import enum
import ipaddress
import math
import operator
import re
import socket
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from operator import attrgetter
from types import MappingProxyType
from typing import Generic, TypeVar

import msgspec
import msgspec.structs

__all__ = [
    "EvidenceKind",
    "IncrementalListing",
    "Instance",
    "InvalidInstanceAddress",
    "ProviderSnapshot",
    "valid_host",
]


class EvidenceKind(enum.Enum):
    """What the presence of an instance in a listing proves."""

    #: Configured by hand; proves nothing about liveness.
    STATIC_FACT = "static_fact"
    #: DNS A/AAAA/SRV: an address exists; no health, no lease.
    ADDRESS_ONLY = "address_only"
    #: The registry's own health evidence (Consul passing checks, Nacos healthy).
    REGISTRY_HEALTH = "registry_health"
    #: A registry lease is alive (etcd): the registrant renews it.
    LEASE = "lease"
    #: Registry health, weakened (Nacos protect threshold returned everyone).
    WEAK_HEALTH = "weak_health"
    #: Orchestrator readiness (Kubernetes EndpointSlice conditions).
    ORCHESTRATOR_READY = "orchestrator_ready"

    @property
    def weak(self) -> bool:
        """Weaker evidence: served by default, refused by strict reads
        (``snapshot(strict=True)``, ``submit_if_current_strict``) with reason
        ``weak``. A provider marks a listing weak by handing it over with
        such a kind (today only :attr:`WEAK_HEALTH`)."""
        return self is EvidenceKind.WEAK_HEALTH


_EMPTY: Mapping[str, str] = MappingProxyType({})


class InvalidInstanceAddress(ValueError):
    """An instance's address is not ``host:port`` with a valid host: an IP
    address or a DNS name. Names the instance; quotes the host only as a
    short excerpt (it is registry text)."""

    def __init__(self, identity: str, host: str, port: int) -> None:
        from ._redact import redacted_excerpt

        self.identity = identity
        self.host = host
        self.port = port
        super().__init__(
            f"instance {redacted_excerpt(identity, limit=80)!r}: address host "
            f"{redacted_excerpt(host, limit=60)!r} is not an IP address or DNS name"
        )


# One DNS label (RFC 1123 letters, digits, hyphens; underscores too, as
# service-discovery names use them), and the whole name.
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
_MAX_NAME = 253
#: Hosts already found valid (hosts repeat across polls): a bounded cache.
_VALID_HOSTS: set[str] = set()
_CACHE_LIMIT = 65536

# A dotted-quad IPv4 address exactly as ``ipaddress.IPv4Address`` accepts
# it: four decimal octets of 0-255, no leading zeros, nothing else. A match
# costs about a seventh of that constructor (no exception when it fails).
_OCTET = r"(?>25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_DOTTED = rf"{_OCTET}\.{_OCTET}\.{_OCTET}\.{_OCTET}"
_IPV4 = re.compile(_DOTTED)
#: Dotted quads joined by newlines: many new hosts checked in one pass in C.
#: Possessive (a quad cannot hold a newline), so a text that fails is given
#: up where it fails.
_IPV4_LINES = re.compile(rf"(?:{_DOTTED}\n)*+{_DOTTED}")


def valid_host(host: str) -> bool:
    """True when ``host`` is an IPv4 or IPv6 address (no brackets; an IPv6
    zone allowed) or a DNS name (labels of 1-63 letters, digits, ``-`` or
    ``_``, not starting or ending with ``-``; 253 characters at most; an
    all-digit last label only as an IPv4 address)."""
    if host in _VALID_HOSTS:
        return True
    ok = _check_host(host)
    if ok:
        if len(_VALID_HOSTS) >= _CACHE_LIMIT:
            _VALID_HOSTS.clear()
        _VALID_HOSTS.add(host)
    return ok


def valid_hosts(hosts: Iterable[str]) -> bool:
    """True when every host of ``hosts`` is valid (:func:`valid_host` of each).

    For a listing's hosts at once: those not cached yet are checked as one
    text when they are all dotted-quad IPv4 addresses (the usual case for
    the first listing of a large service), one by one otherwise.
    """
    new = set(hosts).difference(_VALID_HOSTS)
    if not new:
        return True
    try:
        joined = "\n".join(new)
    except TypeError:  # not all text: valid_host refuses those
        return all(map(valid_host, new))
    if _IPV4_LINES.fullmatch(joined) is None:
        return all(map(valid_host, new))
    if len(_VALID_HOSTS) + len(new) > _CACHE_LIMIT:
        _VALID_HOSTS.clear()
    if len(new) <= _CACHE_LIMIT:
        _VALID_HOSTS.update(new)
    return True


_NUMERIC_LABEL = re.compile(r"^(?:[0-9]+|0x[0-9a-f]*)$")


def numeric_reading(host: str) -> str | None:
    """How resolvers and URL parsers read a host name that is a number in
    disguise (``"0"``, ``"127.1"``, ``"2130706433"``, ``"0x7f.1"``, a last
    label of digits or hex): the dotted quad the C resolver's ``inet_aton``
    makes of it, or ``""`` when it reads none; ``None`` for an IP address in
    its usual form or a real host name."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    bare = host.lower().rstrip(".")
    try:
        return socket.inet_ntoa(socket.inet_aton(bare))
    except (OSError, ValueError):
        pass
    return "" if _NUMERIC_LABEL.match(bare.rsplit(".", 1)[-1]) else None


def canonical_host(host: str) -> str:
    """``host`` spelled one way, for telling whether two hosts are the same:
    an IP address in its compressed form (``0:0:0:0:0:0:0:1`` is ``::1``),
    a name in lower case without a trailing dot."""
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.lower().rstrip(".")


def _check_host(host: str) -> bool:
    if not isinstance(host, str) or not host or not host.isascii():
        return False
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
        return True
    if _IPV4.fullmatch(host) is not None:
        return True
    name = host[:-1] if host.endswith(".") else host
    if not name or len(name) > _MAX_NAME:
        return False
    labels = name.split(".")
    if labels[-1].isdigit():
        return False
    return all(_LABEL.fullmatch(label) for label in labels)


_host_of = attrgetter("host")
_identity_of = attrgetter("identity")
_metadata_of = attrgetter("metadata")
_tags_of = attrgetter("tags")


def _approximate_bytes_of(instances: Sequence[Instance]) -> int:
    """``sum(i.approximate_bytes() for i in instances)``, column by column:
    a pass in C per field, and a Python step only for an instance that has
    metadata or tags."""
    size = 64 * len(instances)
    size += sum(map(len, map(_identity_of, instances)))
    size += sum(map(len, map(_host_of, instances)))
    for metadata in filter(None, map(_metadata_of, instances)):
        size += sum(map(len, metadata)) + sum(map(len, metadata.values()))
    for tags in filter(None, map(_tags_of, instances)):
        size += sum(map(len, tags))
    return size


def _screen(
    instances: tuple[Instance, ...], invalid: Mapping[str, str]
) -> tuple[tuple[Instance, ...], Mapping[str, str]] | None:
    """Instances whose host is not valid (built by ``_trusted_instances``,
    which skips the constructor's checks) moved to ``invalid``; None when
    every host is valid (the common case: one C-level pass and a set
    difference against the cache)."""
    if valid_hosts(map(_host_of, instances)):
        return None
    kept: list[Instance] = []
    refused = dict(invalid)
    for instance in instances:
        if valid_host(instance.host):
            kept.append(instance)
        else:
            error = InvalidInstanceAddress(instance.identity, instance.host, instance.port)
            refused[instance.identity] = str(error)
    return tuple(kept), MappingProxyType(refused)


#: Passed as ``draining`` by :func:`_trusted_instances` only: "already checked".
_TRUSTED: object = object()


class Instance(msgspec.Struct, frozen=True, gc=False):
    """One discovered instance. Immutable; compares by value; hashable (the
    metadata does not take part in the hash).

    A msgspec struct rather than a dataclass: built in C (a quarter of a
    frozen dataclass's construction time, which listings of thousands of
    instances pay per poll or watch event), and untracked by the cyclic
    garbage collector (``gc=False``: an instance refers only to strings,
    numbers and a read-only view of a string-to-string dict, so it cannot be
    part of a reference cycle), so a process holding 10,000 instances does
    not make every full collection walk them. ``msgspec.structs.replace``
    derives a changed copy.
    """

    identity: str
    host: str
    port: int
    weight: float = 1.0
    metadata: Mapping[str, str] = _EMPTY
    tags: tuple[str, ...] = ()
    #: Shutting down: finish the calls in flight, send no new ones.
    draining: bool = False

    def __post_init__(self) -> None:
        if self.draining is _TRUSTED:
            # ``_trusted_instances``: its caller checked every field in bulk.
            _force(self, "draining", False)
            return
        if not self.identity:
            raise ValueError("instance identity must not be empty")
        if not self.host:
            raise ValueError(f"instance {self.identity!r}: host must not be empty")
        if not valid_host(self.host):
            raise InvalidInstanceAddress(self.identity, self.host, self.port)
        if not (0 < self.port < 65536):
            raise ValueError(f"instance {self.identity!r}: port {self.port} out of range 1-65535")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"instance {self.identity!r}: weight must be finite and > 0")
        metadata = self.metadata
        if not isinstance(metadata, MappingProxyType):
            # Empty metadata shares one view (one object fewer per instance).
            _force(self, "metadata", MappingProxyType(dict(metadata)) if metadata else _EMPTY)

    def __hash__(self) -> int:
        return hash((self.identity, self.host, self.port, self.weight, self.tags, self.draining))

    @property
    def address(self) -> str:
        """``host:port`` (IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def approximate_bytes(self) -> int:
        """What this instance counts against ``max_snapshot_bytes``."""
        size = 64 + len(self.identity) + len(self.host)
        if self.metadata:
            size += sum(len(k) + len(v) for k, v in self.metadata.items())
        if self.tags:
            size += sum(len(t) for t in self.tags)
        return size


_force = msgspec.structs.force_setattr


def trusted_instance(
    identity: str,
    host: str,
    port: int,
    weight: float = 1.0,
    metadata: Mapping[str, str] = _EMPTY,
    tags: tuple[str, ...] = (),
    draining: bool = False,
) -> Instance:
    """``Instance(identity, host, port, weight, metadata, tags, draining)`` for a
    decoder that already checked the fields :meth:`Instance.__post_init__`
    checks: ``identity`` non-empty, ``port`` in 1-65535, ``weight`` finite
    and > 0, ``metadata`` a mapping of strings (a ``MappingProxyType`` is
    kept, anything else copied, as the constructor does), ``tags`` a tuple
    of strings, ``draining`` a bool. The host is still
    checked (a cached set look-up for a host seen before): a host that is
    not an IP address or DNS name goes through the validating constructor,
    which raises :class:`InvalidInstanceAddress` exactly as it would.
    Equal to the validating constructor's result for every such input (a
    hypothesis test compares them); what it skips is the constructor's
    Python-level checks, about half the cost of building an instance."""
    if host not in _VALID_HOSTS and not valid_host(host):
        return Instance(identity, host, port, weight, metadata, tags, draining)
    if type(metadata) is not MappingProxyType:
        metadata = MappingProxyType(dict(metadata)) if metadata else _EMPTY
    instance = Instance(identity, host, port, weight, metadata, tags, _TRUSTED)  # type: ignore[arg-type]
    if draining:
        _force(instance, "draining", True)
    return instance


def _trusted_instances(
    identities: Iterable[str],
    hosts: Iterable[str],
    ports: Iterable[int],
    weights: Iterable[float],
    metadata: Iterable[MappingProxyType[str, str]],
) -> list[Instance]:
    """Instances (no tags, not draining) from columns their caller already
    checked as :meth:`Instance.__post_init__` would: identity and host
    non-empty, port in 1-65535, weight finite and > 0, metadata a read-only
    view of a dict nobody mutates (hosts may share one). The checks are
    skipped, not the construction (one ``map`` in C): for providers that
    decode thousands of hosts per poll and validate them in bulk, where the
    checks would cost half as much again as building the instance."""
    return list(
        map(Instance, identities, hosts, ports, weights, metadata, repeat(()), repeat(_TRUSTED))
    )


@dataclass(frozen=True, slots=True)
class ProviderSnapshot:
    """One complete listing of a service, as a provider observed it.

    ``complete`` listings are the only ones a provider hands over; anything
    partial is an :class:`~nadisc.IncompleteSnapshot` failure instead.
    ``invalid`` counts records that were present but malformed (confirmed
    invalid candidates), keyed by the registry's key for the record, so the
    observer can show them; they are never among ``instances``.
    """

    service: str
    instances: tuple[Instance, ...]
    evidence: EvidenceKind
    invalid: Mapping[str, str] = field(default_factory=lambda: _EMPTY, hash=False)
    #: :meth:`approximate_bytes`, once measured (or known from the builder).
    _size: int = field(default=-1, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        screened = _screen(self.instances, self.invalid)
        if screened is not None:
            object.__setattr__(self, "instances", screened[0])
            object.__setattr__(self, "invalid", screened[1])
        seen: set[str] = set()
        for instance in self.instances:
            if instance.identity in seen:
                raise ValueError(
                    f"service {self.service!r}: duplicate instance identity {instance.identity!r}"
                )
            seen.add(instance.identity)
        if not isinstance(self.invalid, MappingProxyType):
            object.__setattr__(self, "invalid", MappingProxyType(dict(self.invalid)))

    def identities(self) -> tuple[str, ...]:
        """Provider instance identities, in listing order."""
        return tuple([i.identity for i in self.instances])

    def approximate_bytes(self) -> int:
        """What this listing counts against ``max_snapshot_bytes`` (measured once)."""
        # A listing built around ``__init__`` (a provider's fast path) may
        # have left the slot unset.
        size: int = getattr(self, "_size", -1)
        if size < 0:
            size = 64 + _approximate_bytes_of(self.instances)
            object.__setattr__(self, "_size", size)
        return size

    @classmethod
    def _checked(
        cls,
        service: str,
        instances: tuple[Instance, ...],
        evidence: EvidenceKind,
        invalid: Mapping[str, str],
        size: int,
    ) -> ProviderSnapshot:
        """A listing whose identities (and size, unless -1) its builder
        already established. Hosts are screened once here (the trusted
        builder skipped the constructor's check): an instance whose host is
        not an IP address or DNS name is left out and listed in ``invalid``
        as an :class:`InvalidInstanceAddress` naming it."""
        screened = _screen(instances, invalid)
        if screened is not None:
            instances, invalid = screened
            size = -1
        return cls._assembled(service, instances, evidence, invalid, size)

    @classmethod
    def _assembled(
        cls,
        service: str,
        instances: tuple[Instance, ...],
        evidence: EvidenceKind,
        invalid: Mapping[str, str],
        size: int,
    ) -> ProviderSnapshot:
        """:meth:`_checked` without the host screen: for instances that all
        went through :class:`Instance`'s own checks (no per-instance work)."""
        snapshot = object.__new__(cls)
        object.__setattr__(snapshot, "service", service)
        object.__setattr__(snapshot, "instances", instances)
        object.__setattr__(snapshot, "evidence", evidence)
        object.__setattr__(
            snapshot,
            "invalid",
            invalid if isinstance(invalid, MappingProxyType) else MappingProxyType(dict(invalid)),
        )
        object.__setattr__(snapshot, "_size", size)
        return snapshot


#: The key type of an :class:`IncrementalListing` (the registry's own keys).
K = TypeVar("K", str, bytes)


class IncrementalListing(Generic[K]):
    """A listing kept in key order and updated one change at a time.

    For providers that follow a stream of changes (a watch): :meth:`put` and
    :meth:`discard` keep the instances sorted by the provider's key (``bytes`` or
    ``str``), count identities and keep the
    byte total that :meth:`ProviderSnapshot.approximate_bytes` reports, so a
    batch of k changes costs O(k log n) comparisons. :meth:`snapshot` hands
    out a :class:`ProviderSnapshot` holding one copy of the tuple of
    references (O(n) in C, no Python work per instance), the same object
    again while nothing changed. Instances are kept as given: an unchanged
    one stays the very same object, so comparing two snapshots is cheap.

    Two keys carrying one identity are allowed in between; :meth:`snapshot`
    refuses them with ``ValueError``, as ``ProviderSnapshot`` would.
    """

    __slots__ = (
        "_by_key",
        "_cached",
        "_duplicates",
        "_identities",
        "_instances",
        "_keys",
        "_size",
    )

    def __init__(self) -> None:
        self._keys: list[K] = []
        self._instances: list[Instance] = []
        self._by_key: dict[K, Instance] = {}
        self._identities: dict[str, int] = {}
        self._duplicates = 0
        self._size = 64
        self._cached: ProviderSnapshot | None = None

    @classmethod
    def from_sorted(cls, keys: list[K], instances: list[Instance]) -> IncrementalListing[K]:
        """A listing of ``instances[i]`` under ``keys[i]``, built in bulk:
        for keys that arrive in ascending order (a registry's range), the
        same listing as :meth:`put` of each pair, without the per-key binary
        search, list insert and bookkeeping (the counts are taken once, in
        C). The lists are taken over, not copied. Keys out of order or
        repeated are put one by one (the same result, at :meth:`put`'s cost).
        """
        listing: IncrementalListing[K] = cls()
        if len(keys) != len(instances):
            raise ValueError("from_sorted needs one instance per key")
        if any(map(operator.ge, keys, islice(keys, 1, None))):
            for key, instance in zip(keys, instances, strict=True):
                listing.put(key, instance)
            return listing
        # Identities are distinct in the common case: one C pass, counted
        # only when some repeat.
        counts = dict.fromkeys(map(_identity_of, instances), 1)
        if len(counts) != len(instances):
            counts = dict(Counter(map(_identity_of, instances)))
        listing._keys = keys
        listing._instances = instances
        listing._by_key = dict(zip(keys, instances, strict=True))
        listing._identities = counts
        listing._duplicates = len(instances) - len(counts)
        listing._size = 64 + _approximate_bytes_of(instances)
        return listing

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def get(self, key: K) -> Instance | None:
        return self._by_key.get(key)

    @property
    def approximate_bytes(self) -> int:
        """The byte total of the listing, kept by difference."""
        return self._size

    def _count(self, instance: Instance, step: int, size: int) -> None:
        identity = instance.identity
        before = self._identities.get(identity, 0)
        after = before + step
        if after:
            self._identities[identity] = after
        else:
            del self._identities[identity]
        # Keys beyond the first one carrying an identity are duplicates.
        self._duplicates += max(after - 1, 0) - max(before - 1, 0)
        self._size += step * size

    def put(self, key: K, instance: Instance) -> None:
        """Insert or replace the instance stored under ``key``."""
        old = self._by_key.get(key)
        if old is instance:
            return
        self._cached = None
        keys = self._keys
        if old is None:
            at = bisect.bisect_left(keys, key)
            keys.insert(at, key)
            self._instances.insert(at, instance)
        else:
            at = bisect.bisect_left(keys, key)
            self._instances[at] = instance
            self._count(old, -1, old.approximate_bytes())
        self._by_key[key] = instance
        self._count(instance, 1, instance.approximate_bytes())

    def discard(self, key: K) -> bool:
        """Remove ``key``; True if it was there."""
        old = self._by_key.pop(key, None)
        if old is None:
            return False
        self._cached = None
        at = bisect.bisect_left(self._keys, key)
        del self._keys[at]
        del self._instances[at]
        self._count(old, -1, old.approximate_bytes())
        return True

    def clear(self) -> None:
        self._keys.clear()
        self._instances.clear()
        self._by_key.clear()
        self._identities.clear()
        self._duplicates = 0
        self._size = 64
        self._cached = None

    def snapshot(
        self,
        service: str,
        evidence: EvidenceKind,
        invalid: Mapping[str, str] = _EMPTY,
    ) -> ProviderSnapshot:
        """The listing now (``ValueError`` if two keys share an identity)."""
        if self._duplicates:
            seen: set[str] = set()
            for instance in self._instances:
                if instance.identity in seen:
                    raise ValueError(
                        f"service {service!r}: duplicate instance identity {instance.identity!r}"
                    )
                seen.add(instance.identity)
        cached = self._cached
        if (
            cached is not None
            and cached.service == service
            and cached.evidence is evidence
            and (cached.invalid is invalid or cached.invalid == invalid)
        ):
            return cached
        # Every instance here was built by Instance (hosts checked).
        snapshot = ProviderSnapshot._assembled(
            service, tuple(self._instances), evidence, invalid, self._size
        )
        self._cached = snapshot
        return snapshot
