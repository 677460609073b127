"""Sans-IO timing decisions of the host (synchronous, time passed in).

:class:`EligibilityLease` — the host's renewal of its own local
eligibility: every ``every`` seconds it grants ``grant`` seconds more; a
renewal that comes after the previous grant expired reports how long the
eligibility had lapsed (the event loop was blocked, or the host stalled)::

    NEVER ─renew(now)─► GRANTED(until now+grant) ─renew(later)─► GRANTED ...
                                      └── now > until ── lapsed for now-until

:class:`ShutdownBudget` — one shutdown's deadlines: the deregistration wait
ends at ``started + quiesce``; the drain gets ``drain`` seconds from when
it starts; the owner's shared deadline (quiesce and close) is ``started +
quiesce + grace + drain``; the shutdown is over budget when it ends after
that. O(1) each.

:func:`default_deregister_grace` — how long a host keeps serving after its
deregistration was acknowledged, so that callers learn of the removal
before it refuses (the Kubernetes preStop pattern): the longest of the
per-provider times of the connections its registrations write to
(:data:`DEREGISTER_GRACE_MS`; a provider that is only polled gets its
connection's ``poll_interval_ms + request_timeout_ms``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._config import DiscoveryConfig

__all__ = ["DEREGISTER_GRACE_MS", "EligibilityLease", "ShutdownBudget", "default_deregister_grace"]

#: Default deregistration grace (ms) by provider: how long its callers may
#: take to learn of a removal. Watching providers learn within a round trip
#: (etcd watch, Consul blocking query re-issued at most twice a second by
#: its rate limit, Kubernetes watches); the grace covers that with a margin
#: for busy callers; static and DNS connections cannot register, and the
#: in-process memory registry tells its watchers at once. Providers not
#: listed (Nacos, unknown ones) are polled: their connection's
#: ``poll_interval_ms + request_timeout_ms``.
DEREGISTER_GRACE_MS: Mapping[str, int] = {
    "etcd": 1000,
    "consul": 2000,
    "kubernetes": 3000,
    "static": 0,
    "dns": 0,
    "memory": 0,
}


@dataclass(slots=True)
class EligibilityLease:
    """When to renew the host's eligibility, and whether it lapsed meanwhile."""

    grant: float = 5.0
    every: float = 1.0
    until: float | None = None

    def __post_init__(self) -> None:
        if not (0 < self.every < self.grant) or not math.isfinite(self.grant):
            raise ValueError(
                f"renew every {self.every} s must be positive and shorter than the grant "
                f"({self.grant} s)"
            )

    def renew(self, now: float) -> float | None:
        """Record a renewal at ``now``; the lapse in seconds if the grant had expired."""
        lapsed = None if self.until is None or now <= self.until else now - self.until
        self.until = now + self.grant
        return lapsed

    def next_renewal(self, now: float) -> float:
        """When the next renewal is due (``now`` before the first one)."""
        if self.until is None:
            return now
        return self.until - self.grant + self.every


@dataclass(frozen=True, slots=True)
class ShutdownBudget:
    """The deadlines of one shutdown started at ``started`` (all in seconds)."""

    started: float
    quiesce: float
    drain: float
    #: Serving on after the deregistration, before refusing (seconds).
    grace: float = 0.0

    def __post_init__(self) -> None:
        for label, value in (
            ("quiesce", self.quiesce),
            ("drain", self.drain),
            ("grace", self.grace),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"the {label} budget must be a finite number >= 0, not {value}")

    @property
    def quiesce_until(self) -> float:
        """The deregistration wait ends here."""
        return self.started + self.quiesce

    @property
    def deadline(self) -> float:
        """The owner's shared shutdown deadline (quiesce and close)."""
        return self.started + self.quiesce + self.grace + self.drain

    def refuse_at(self, deregistered: float) -> float:
        """New requests are refused from here (the grace after the deregistration)."""
        return deregistered + self.grace

    def drain_until(self, drain_started: float) -> float:
        """The in-flight drain, started at ``drain_started``, ends here."""
        return drain_started + self.drain

    def over(self, now: float) -> float:
        """Seconds past the budget at ``now`` (0 within it)."""
        return max(0.0, now - self.deadline)


def default_deregister_grace(config: DiscoveryConfig) -> float:
    """The grace (seconds) of a host with ``config``: see the module documentation.

    0 when nothing is registered. The longest over the connections that
    registrations write to.
    """
    grace_ms = 0
    for registration in config.registrations.values():
        connection = config.connections.get(registration.qualifier)
        if connection is None:
            continue
        known = DEREGISTER_GRACE_MS.get(connection.provider)
        if known is None:
            known = connection.poll_interval_ms + connection.request_timeout_ms
        grace_ms = max(grace_ms, known)
    return grace_ms / 1000.0
