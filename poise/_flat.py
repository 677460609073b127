"""Flat load state: where a PeakEwma tracker keeps its numbers, one slot per endpoint.

A :class:`PickTable` holds the state of :class:`~poise.PeakEwma` trackers in
flat, typed per-slot arrays: the stored estimate ``E``, the time ``u`` it was
last set, the calls in flight, the start of the oldest call in flight, the
decay rate, the number of observations and whether the age floor applies.
A tracker's state lives in exactly one slot of one table, and nowhere else:

* a :class:`~poise.Balance` gives every endpoint it holds a slot in the
  balance's table when the endpoint joins, and a ``PeakEwma`` tracker it can
  take (no slow start, not already held by another balance, such as a
  tracker shared by two endpoints) is *bound* there: its state moves into
  the slot, and moves out again, to a one-slot table of its own, when the
  endpoint leaves;
* a tracker in no balance keeps its state in a one-slot table of its own,
  made at its first use.

So a power-of-two-choices pick reads two slots of a few arrays, and a call
dispatched by the balance starts and ends by editing its slot in place, with
no endpoint, tracker, guard or dictionary object in between. The cost of a
slot is::

    cost = max(fade(estimate, now - updated), now - oldest) x (in_flight + 1)

exactly as :meth:`PeakEwma.load` computes it (``oldest`` is infinite when no
call is in flight or the tracker has ``age_floor=False``; ``updated`` is
infinite before the tracker's first use, which the reader then records).
:func:`cost` is that formula; :meth:`PickTable.pick` and
``Balance.dispatch`` repeat it (and the start and end of a call) inline, on
purpose: they are the hot path. ``tests/poise/test_flat_pick.py`` checks
every copy against a plain reference model of the rules at every step.

Calls in flight: a slot counts them, and with the age floor it keeps the
start of the oldest one in ``oldest`` and the starts of the others, sorted,
in a list of its own (``later``; made when an endpoint first has two calls
in flight at once). Starting or ending the only call in flight of an
endpoint is O(1); with ``k`` calls in flight it is a C-level insertion or
deletion in a list of ``k - 1`` floats.

A balance picks through its policy instead while any endpoint's tracker is
not bound in its table (another kind of tracker, a ``PeakEwma`` with
``slow_start``, or one held by another balance): ``unbound`` counts them.

Cost: ``occupy`` and ``vacate`` are O(1) (a departing tracker gets a
one-slot table); a freed slot is reused by the next endpoint that joins, so
the arrays stay as long as the most endpoints held at once.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from ._peak_ewma import PeakEwma

__all__ = ["PickTable", "cost"]

_INF = math.inf
_exp = math.exp
# The estimate never reaches zero: a zero estimate would make the cost ignore
# the calls in flight and pull every request to one endpoint.
_MIN_ESTIMATE = 1e-6


class PickTable:
    """Per-slot PeakEwma state: a balance's table, or a tracker's own one-slot table.

    ``estimate``, ``updated``, ``in_flight``, ``oldest``, ``rate``,
    ``observations``, ``floor`` and ``later`` are indexed by slot (see the
    module docs); ``trackers`` holds each occupied slot's tracker and
    ``bound`` whether that tracker's state lives in the slot; ``unbound``
    counts the occupied slots whose tracker's state does not. ``vacated``
    grows by one whenever a slot is freed, so a call that remembered it can
    tell that its slot still belongs to its tracker.
    """

    __slots__ = (
        "_rates",
        "bound",
        "calls",
        "estimate",
        "floor",
        "free",
        "in_flight",
        "later",
        "observations",
        "oldest",
        "rate",
        "trackers",
        "unbound",
        "updated",
        "vacated",
    )

    def __init__(self) -> None:
        # Plain lists, not typed arrays: CPython reads and writes a list
        # item in one specialized bytecode, where an array item goes through
        # the generic item protocol, argument parsing and a new float or int
        # object (measured: about a third of a dispatch's extra instructions).
        self.estimate: list[float] = []
        self.updated: list[float] = []
        self.in_flight: list[int] = []
        self.oldest: list[float] = []
        self.rate: list[float] = []
        self.observations: list[int] = []
        self.floor: list[bool] = []
        self.later: list[list[float] | None] = []
        # For the balance: the service's call of a steady endpoint (always
        # ready, reserving nothing), else None. Kept here so a dispatch to
        # such an endpoint reads no service object.
        self.calls: list[Callable[[Any], Awaitable[Any]] | None] = []
        self.bound: list[bool] = []
        self.trackers: list[object] = []
        self.free: list[int] = []
        self.unbound = 0
        self.vacated = 0
        # One float object per distinct decay rate: slots read the same
        # object rather than one each, which keeps the data a pick touches
        # small when thousands of trackers share a decay.
        self._rates: dict[float, float] = {}

    def occupy(self, tracker: object, bind: bool) -> int:
        """A slot for a joining endpoint's tracker; with ``bind``, its state moves in.

        ``bind`` only for a tracker that ``poise._peak_ewma.binds``.
        """
        slot = self._slot_for(tracker)
        if bind:
            self.bound[slot] = True
            cast("PeakEwma", tracker)._move(self, slot, bound=True)
        else:
            self.unbound += 1
        return slot

    def vacate(self, slot: int, tracker: object) -> None:
        """Free a departing endpoint's slot; a bound tracker takes its state along."""
        if self.bound[slot]:
            self.bound[slot] = False
            cast("PeakEwma", tracker)._move(PickTable(), -1, bound=False)
        else:
            self.unbound -= 1
        self.trackers[slot] = None
        self.in_flight[slot] = 0
        self.oldest[slot] = _INF
        self.updated[slot] = _INF
        self.later[slot] = None
        self.calls[slot] = None
        self.vacated += 1
        self.free.append(slot)

    def _slot_for(self, tracker: object) -> int:
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
            self.observations.append(0)
            self.floor.append(False)
            self.later.append(None)
            self.calls.append(None)
            self.bound.append(False)
            self.trackers.append(None)
        self.trackers[slot] = tracker
        return slot

    def fill(self, slot: int, tracker: PeakEwma, source: PickTable | None, at: int) -> None:
        """Write ``tracker``'s state into ``slot``: row ``at`` of ``source``, or a fresh one."""
        rate = tracker._rate
        self.rate[slot] = self._rates.setdefault(rate, rate)
        self.floor[slot] = tracker._age_floor
        if source is None:
            self.estimate[slot] = tracker._default_rtt
            self.updated[slot] = _INF
            self.in_flight[slot] = 0
            self.oldest[slot] = _INF
            self.observations[slot] = 0
            self.later[slot] = None
        else:
            self.estimate[slot] = source.estimate[at]
            self.updated[slot] = source.updated[at]
            self.in_flight[slot] = source.in_flight[at]
            self.oldest[slot] = source.oldest[at]
            self.observations[slot] = source.observations[at]
            self.later[slot] = source.later[at]

    def pick(self, slots: list[int], draw: Callable[[], float], now: float) -> int:
        """:class:`~poise.PowerOfTwoChoices` over ``slots`` (every one bound).

        The same draws, costs and comparison as the policy with the
        trackers' ``load(now)``, read from the lists: returns the position
        in ``slots`` the policy would return for the same generator state.
        The slot at that position has been used (its first use recorded).
        ``now`` must be finite.
        """
        n = len(slots)
        if n <= 1:
            if n and self.updated[slots[0]] == _INF:
                self.updated[slots[0]] = now
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
        # The policy reads the second sample's load first. Both costs are
        # cost(self, slot, now), written out: this runs on every dispatch.
        slot = slots[second]
        gap = updated[slot] - now
        if gap < 0.0:
            cost = estimate[slot] * _exp(gap * rate[slot])
            if cost < _MIN_ESTIMATE:
                cost = _MIN_ESTIMATE
        else:
            if gap == _INF:
                updated[slot] = now  # the first use
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
                updated[slot] = now  # the first use
            cost = estimate[slot]
        age = now - oldest[slot]
        if age > cost:
            cost = age
        if cost_second < cost * (in_flight[slot] + 1):
            return second
        return first

    def row(self, slot: int) -> tuple[float, float, int, float, float, int]:
        """One slot's numbers: (estimate, updated, in_flight, oldest, rate, observations)."""
        return (
            self.estimate[slot],
            self.updated[slot],
            self.in_flight[slot],
            self.oldest[slot],
            self.rate[slot],
            self.observations[slot],
        )

    def __repr__(self) -> str:
        used = len(self.estimate) - len(self.free)
        return f"<PickTable slots={used} unbound={self.unbound} free={len(self.free)}>"


# -- the rules over one slot (see poise._peak_ewma for what they mean) ---------


def cost(table: PickTable, slot: int, now: float) -> float:
    """``max(estimate(now), oldest call's age) x (in_flight + 1)``; records a first use."""
    gap = table.updated[slot] - now
    if gap < 0.0:
        estimate = table.estimate[slot] * _exp(gap * table.rate[slot])
        if estimate < _MIN_ESTIMATE:
            estimate = _MIN_ESTIMATE
    else:
        if gap == _INF:
            table.updated[slot] = now  # the first use
        estimate = table.estimate[slot]
    age = now - table.oldest[slot]
    if age > estimate:
        estimate = age
    return estimate * (table.in_flight[slot] + 1)


def faded(table: PickTable, slot: int, now: float) -> float:
    """The stored estimate faded by the time since it was set (no first use recorded)."""
    estimate = table.estimate[slot]
    gap = now - table.updated[slot]
    if gap > 0.0:
        estimate *= _exp(-gap * table.rate[slot])
        if estimate < _MIN_ESTIMATE:
            estimate = _MIN_ESTIMATE
    return estimate


def start_call(table: PickTable, slot: int, now: float) -> None:
    """Count a call started at ``now`` (its slot has been used)."""
    in_flight = table.in_flight
    k = in_flight[slot]
    in_flight[slot] = k + 1
    if table.floor[slot]:
        if not k:
            table.oldest[slot] = now
        else:
            _also_started(table, slot, now)


def _also_started(table: PickTable, slot: int, now: float) -> None:
    """A call started while others are in flight (age floor on): keep the starts sorted."""
    later = table.later[slot]
    if later is None:
        later = table.later[slot] = []
    oldest = table.oldest[slot]
    if now < oldest:
        table.oldest[slot] = now
        later.insert(0, oldest)
    elif not later or now >= later[-1]:
        later.append(now)
    else:
        insort(later, now)


def end_in_flight(table: PickTable, slot: int, started: float) -> None:
    """Stop counting a call started at ``started``; the oldest call moves on if it was it."""
    in_flight = table.in_flight
    k = in_flight[slot] - 1
    in_flight[slot] = k
    if table.floor[slot]:
        if not k:
            table.oldest[slot] = _INF
        else:
            _one_ended(table, slot, started)


def _one_ended(table: PickTable, slot: int, started: float) -> None:
    """One of several calls in flight ended (age floor on)."""
    later = table.later[slot]
    assert later
    if started == table.oldest[slot]:
        table.oldest[slot] = later.pop(0)
    else:
        del later[bisect_left(later, started)]


def complete_call(
    table: PickTable, slot: int, started: float, now: float, failed: bool, penalty: float
) -> None:
    """A call started at ``started`` completed at ``now``: the peak rule (see PeakEwma).

    ``now`` is finite and not before ``started`` (the caller checked).
    """
    rtt = now - started
    end_in_flight(table, slot, started)
    estimate = table.estimate[slot]
    updated = table.updated[slot]
    # Completions may be reported slightly out of order; a negative gap
    # counts as no time at all (the prior keeps its full weight, unfaded).
    elapsed = now - updated
    weight = _exp(-elapsed * table.rate[slot]) if elapsed > 0.0 else 1.0
    estimate *= weight
    if failed and penalty > 0.0:
        # A failure is never evidence of speed (see "Failures" in PeakEwma).
        cap = 10.0 * penalty
        if rtt > cap:
            cap = rtt
        doubled = 2.0 * estimate
        if doubled > cap:
            doubled = cap
        if rtt < penalty:
            rtt = penalty
        if rtt < doubled:
            rtt = doubled
        if rtt < estimate:
            rtt = estimate  # above the cap already: kept, not lowered
    if rtt > estimate:
        estimate = rtt
    else:
        estimate = estimate * weight + rtt * (1.0 - weight)
        if estimate < _MIN_ESTIMATE:
            estimate = _MIN_ESTIMATE
    table.estimate[slot] = estimate
    if now > updated:
        table.updated[slot] = now
    table.observations[slot] += 1


def cancel_call(table: PickTable, slot: int, started: float, now: float, evidence: bool) -> None:
    """A call started at ``started`` was abandoned at ``now``; maybe raise the estimate."""
    end_in_flight(table, slot, started)
    age = now - started
    if evidence and age > 0.0 and age > faded(table, slot, now):
        # A call outstanding this long proves an RTT of at least its age:
        # raise the estimate as a completion of that age would.
        table.estimate[slot] = age
        if now > table.updated[slot]:
            table.updated[slot] = now
