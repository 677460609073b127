"""The default load tracker: count the calls in flight.

:class:`InFlight` is the tracker every :class:`~poise.Endpoint` gets unless
another one is supplied. Its load is the number of dispatched calls that have
not ended yet, with no upper bound and no notion of time (``now`` is accepted
for the protocol and ignored)::

    tracker.start(now) ──► guard          load += 1
    guard.complete(now)  ─┐
    guard.cancel(now)    ─┴─► (first one)  load -= 1
                              (any later)  no-op

A guard ends exactly once, so an error path that both completes and cancels a
guard, or a response body closed twice, never drives the count below the
number of calls really in flight.

Cost: ``start`` allocates one small guard object; ``load``, ``complete`` and
``cancel`` are O(1) and allocate nothing.
"""

from __future__ import annotations

__all__ = ["InFlight", "InFlightGuard"]


class InFlight:
    """Unbounded in-flight counter; ``load(now)`` is the number of open guards."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count = 0

    @property
    def in_flight(self) -> int:
        """Calls started and not yet completed or cancelled."""
        return self._count

    def load(self, now: float) -> float:
        return self._count

    def start(self, now: float) -> InFlightGuard:
        self._count += 1
        return InFlightGuard(self)

    def __repr__(self) -> str:
        return f"<InFlight in_flight={self._count}>"


class InFlightGuard:
    """The guard of one call counted by an :class:`InFlight` tracker."""

    __slots__ = ("_tracker",)

    def __init__(self, tracker: InFlight) -> None:
        self._tracker: InFlight | None = tracker

    @property
    def ended(self) -> bool:
        return self._tracker is None

    def complete(self, now: float, *, failed: bool = False) -> None:
        tracker = self._tracker
        if tracker is not None:
            self._tracker = None
            tracker._count -= 1

    def cancel(self, now: float) -> None:
        tracker = self._tracker
        if tracker is not None:
            self._tracker = None
            tracker._count -= 1

    def __repr__(self) -> str:
        return f"<InFlightGuard {'ended' if self._tracker is None else 'open'}>"
