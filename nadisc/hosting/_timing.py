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
quiesce + drain``; the shutdown is over budget when it ends after that.
O(1) each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["EligibilityLease", "ShutdownBudget"]


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

    def __post_init__(self) -> None:
        for label, value in (("quiesce", self.quiesce), ("drain", self.drain)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"the {label} budget must be a finite number >= 0, not {value}")

    @property
    def quiesce_until(self) -> float:
        """The deregistration wait ends here."""
        return self.started + self.quiesce

    @property
    def deadline(self) -> float:
        """The owner's shared shutdown deadline (quiesce and close)."""
        return self.started + self.quiesce + self.drain

    def drain_until(self, drain_started: float) -> float:
        """The in-flight drain, started at ``drain_started``, ends here."""
        return drain_started + self.drain

    def over(self, now: float) -> float:
        """Seconds past the budget at ``now`` (0 within it)."""
        return max(0.0, now - self.deadline)
