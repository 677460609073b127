"""Flat pick data: what a power-of-two-choices pick reads, one slot per endpoint.

A :class:`~poise.Balance` gives every endpoint it holds a *slot* in its
:class:`PickTable` when the endpoint joins and frees it when the endpoint
leaves. A :class:`~poise.PeakEwma` tracker of such an endpoint is *bound* to
the slot: from then on it writes the inputs of its cost into the table's
lists in place, at every change (a call started, completed or cancelled, the
first use), so a pick reads two slots of a few flat lists instead of
following endpoint, tracker and dictionary objects::

    cost = max(fade(estimate, now - updated), now - oldest) x (in_flight + 1)

exactly as :meth:`PeakEwma.load` computes it (``oldest`` is infinite when no
call is in flight or the tracker has ``age_floor=False``; ``updated`` is
infinite before the tracker's first use, which the pick then records).

The tracker stays the source of truth; the table is a mirror it keeps
current. A tracker the table cannot mirror (another kind, a
``PeakEwma`` with ``slow_start``, or one already bound elsewhere, such as a
tracker shared by two endpoints) leaves its slot *unbound*, and the balance
picks through the policy while any such endpoint is present.

Cost: binding and unbinding are O(1); a freed slot is reused by the next
endpoint that joins, so the lists stay as long as the most endpoints held
at once.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable

from ._peak_ewma import _MIN_ESTIMATE, PeakEwma

__all__ = ["PickTable"]

_INF = math.inf
_exp = math.exp


class PickTable:
    """Per-slot lists of the PeakEwma cost inputs, owned by one balance.

    ``estimate``, ``updated``, ``in_flight``, ``oldest`` and ``rate`` are
    indexed by slot; ``bound`` says whether the slot's tracker mirrors itself
    there; ``unbound`` counts the occupied slots that do not.
    """

    __slots__ = (
        "bound",
        "estimate",
        "free",
        "in_flight",
        "oldest",
        "rate",
        "trackers",
        "unbound",
        "updated",
    )

    def __init__(self) -> None:
        # Typed arrays: a read touches the array's own contiguous buffer,
        # never a float or int object allocated somewhere else.
        self.estimate = array("d")
        self.updated = array("d")
        self.in_flight = array("q")
        self.oldest = array("d")
        self.rate = array("d")
        self.bound: list[bool] = []
        self.trackers: list[object] = []
        self.free: list[int] = []
        self.unbound = 0

    def occupy(self, tracker: object) -> int:
        """A slot for a joining endpoint's tracker; binds it when it can be mirrored."""
        free = self.free
        if free:
            slot = free.pop()
        else:
            slot = len(self.estimate)
            self.estimate.append(0.0)
            self.updated.append(_INF)
            self.in_flight.append(0)
            self.oldest.append(_INF)
            self.rate.append(0.0)
            self.bound.append(False)
            self.trackers.append(None)
        self.trackers[slot] = tracker
        if type(tracker) is PeakEwma and tracker._table is None and tracker._slow_start == 0.0:
            tracker._table = self
            tracker._slot = slot
            self.rate[slot] = tracker._rate
            self.bound[slot] = True
            tracker._mirror()
        else:
            self.bound[slot] = False
            self.unbound += 1
        return slot

    def vacate(self, slot: int, tracker: object) -> None:
        """Free a departing endpoint's slot and unbind its tracker."""
        if self.bound[slot]:
            self.bound[slot] = False
            if type(tracker) is PeakEwma and tracker._table is self:
                tracker._table = None
                tracker._slot = -1
        else:
            self.unbound -= 1
        self.trackers[slot] = None
        self.in_flight[slot] = 0
        self.oldest[slot] = _INF
        self.updated[slot] = _INF
        self.free.append(slot)

    def pick(self, slots: array[int], draw: Callable[[], float], now: float) -> int:
        """:class:`~poise.PowerOfTwoChoices` over ``slots`` (every one bound).

        The same draws, costs and comparison as the policy with the
        trackers' ``load(now)``, read from the lists: returns the position in
        ``slots`` the policy would return for the same generator state.
        """
        n = len(slots)
        if n <= 1:
            return 0
        first = int(draw() * n)
        second = int(draw() * (n - 1))
        if second >= first:
            second += 1
        estimate = self.estimate
        updated = self.updated
        oldest = self.oldest
        rate = self.rate
        in_flight = self.in_flight
        # The policy reads the second sample's load first.
        slot = slots[second]
        gap = updated[slot] - now
        if gap < 0.0:
            cost = estimate[slot] * _exp(gap * rate[slot])
            if cost < _MIN_ESTIMATE:
                cost = _MIN_ESTIMATE
        else:
            if gap == _INF:
                self.first_use(slot, now)
            cost = estimate[slot]
        age = now - oldest[slot]
        if age > cost:
            cost = age
        cost_second = cost * (in_flight[slot] + 1)
        slot = slots[first]
        gap = updated[slot] - now
        if gap < 0.0:
            cost = estimate[slot] * _exp(gap * rate[slot])
            if cost < _MIN_ESTIMATE:
                cost = _MIN_ESTIMATE
        else:
            if gap == _INF:
                self.first_use(slot, now)
            cost = estimate[slot]
        age = now - oldest[slot]
        if age > cost:
            cost = age
        if cost_second < cost * (in_flight[slot] + 1):
            return second
        return first

    def first_use(self, slot: int, now: float) -> None:
        """A bound tracker read for the first time: it records ``now``, as ``load`` does."""
        tracker = self.trackers[slot]
        assert type(tracker) is PeakEwma
        if tracker._epoch is None:
            tracker._first_use(now)

    def row(self, slot: int) -> tuple[float, float, int, float, float]:
        """One slot's mirrored values: (estimate, updated, in_flight, oldest, rate)."""
        return (
            self.estimate[slot],
            self.updated[slot],
            self.in_flight[slot],
            self.oldest[slot],
            self.rate[slot],
        )

    def __repr__(self) -> str:
        used = len(self.estimate) - len(self.free)
        return f"<PickTable slots={used} unbound={self.unbound} free={len(self.free)}>"
