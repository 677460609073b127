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
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["EvidenceKind", "Instance", "ProviderSnapshot"]


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


@dataclass(frozen=True, slots=True)
class Instance:
    """One discovered instance. Immutable; compares by value."""

    identity: str
    host: str
    port: int
    weight: float = 1.0
    metadata: Mapping[str, str] = field(default_factory=lambda: _EMPTY, hash=False)
    tags: tuple[str, ...] = ()
    #: Shutting down: finish the calls in flight, send no new ones.
    draining: bool = False

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("instance identity must not be empty")
        if not self.host:
            raise ValueError(f"instance {self.identity!r}: host must not be empty")
        if not (0 < self.port < 65536):
            raise ValueError(f"instance {self.identity!r}: port {self.port} out of range 1-65535")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"instance {self.identity!r}: weight must be finite and > 0")
        if not isinstance(self.metadata, MappingProxyType):
            object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))

    @property
    def address(self) -> str:
        """``host:port`` (IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def approximate_bytes(self) -> int:
        """What this instance counts against ``max_snapshot_bytes``."""
        size = 64 + len(self.identity) + len(self.host)
        size += sum(len(k) + len(v) for k, v in self.metadata.items())
        size += sum(len(t) for t in self.tags)
        return size


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

    def __post_init__(self) -> None:
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
        return tuple(i.identity for i in self.instances)

    def approximate_bytes(self) -> int:
        return 64 + sum(i.approximate_bytes() for i in self.instances)
