"""Flat load state: a PeakEwma tracker's numbers in one small record, its *row*.

A :class:`~poise.PeakEwma` keeps its whole state in one :class:`Row`, a
record with eight slots made with the tracker and never replaced::

    Row(estimate, updated, in_flight, rate, oldest, observations, floor, later)

``estimate`` is the stored estimate ``E``; ``updated`` the time ``u`` it was
last set (infinite before the tracker's first use, which the first reader
records); ``in_flight`` the calls in flight; ``oldest`` the earliest start
among them (infinite when none is in flight, or without the age floor);
``rate`` is ``1 / decay``; ``observations`` counts completed calls;
``floor`` is ``age_floor``; ``later`` holds the starts of the other calls in
flight, sorted (made when an endpoint first has two calls in flight at
once; with the age floor only).

A :class:`~poise.Balance` keeps, beside its list of READY endpoints, the
list of their trackers' rows (``_rrows``). A power-of-two-choices pick then
reads two rows, and a call that ``Balance.dispatch`` makes starts and ends
by editing its row in place, with no endpoint, tracker, guard or dictionary
object in between. A row stays the tracker's wherever the endpoint goes, so
a call still in flight when its endpoint leaves the balance ends on the
right state. The cost of a row is::

    cost = max(fade(estimate, now - updated), now - oldest) x (in_flight + 1)

exactly as :meth:`PeakEwma.load` computes it. :func:`pick` and
``Balance.dispatch`` (and ``PeakEwma.load``) write that formula out, and
dispatch also the start and the end of a call, on purpose: they are the hot
path. ``tests/poise/test_flat_pick.py`` checks every copy against a plain
reference model of the rules at every step.

Why a record per tracker and not one array per field: CPython reads and
writes a slot attribute (or a list item) in one specialized bytecode, where
a typed array item goes through the generic item protocol, argument parsing
and a new float or int object (measured: about 6,000 more instructions per
dispatch); and with one list per field a pick touched a cache line in each
of them, where a row keeps a tracker's numbers together, the ones a pick
reads next to the row's header (measured against a plain list per row:
about 5% less CPU per dispatch among 10,000 endpoints).

A balance picks through its policy instead while any of its endpoints has
a tracker without a row it can read (another kind of tracker, or a
``PeakEwma`` with ``slow_start``, whose cost the row does not describe).

Cost: O(1) per pick, start and end while an endpoint has at most one call
in flight; with ``k`` in flight, a start or end adds a C-level insertion or
deletion in a list of ``k - 1`` floats.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable

__all__ = ["Row", "cancel_call", "complete_call", "faded", "new_row", "pick", "start_call"]

_INF = math.inf
_exp = math.exp
# The estimate never reaches zero: a zero estimate would make the cost ignore
# the calls in flight and pull every request to one endpoint.
_MIN_ESTIMATE = 1e-6
# One float object per distinct decay rate, so that rows of trackers with
# the same decay share it (fewer objects for a pick to touch).
_RATES: dict[float, float] = {}


class Row:
    """One tracker's state; see the module docs. Made by :func:`new_row`."""

    # The fields a pick reads come first, next to the object's header: a
    # row of a random tracker among thousands then costs one or two cache
    # lines. (Not sorted on purpose.)
    __slots__ = (  # noqa: RUF023
        "estimate",
        "updated",
        "in_flight",
        "rate",
        "oldest",
        "observations",
        "floor",
        "later",
    )

    estimate: float
    updated: float
    in_flight: int
    rate: float
    oldest: float
    observations: int
    floor: bool
    later: list[float] | None

    def __repr__(self) -> str:
        return (
            f"<Row estimate={self.estimate!r} updated={self.updated!r} "
            f"in_flight={self.in_flight} observations={self.observations}>"
        )


def new_row(default_rtt: float, rate: float, floor: bool) -> Row:
    """A fresh state: ``default_rtt``, never used, nothing in flight."""
    row = Row()
    row.estimate = default_rtt
    row.updated = _INF
    row.in_flight = 0
    row.rate = _RATES.setdefault(rate, rate)
    row.oldest = _INF
    row.observations = 0
    row.floor = floor
    row.later = None
    return row


def pick(rows: list[Row], draw: Callable[[], float], now: float) -> int:
    """:class:`~poise.PowerOfTwoChoices` over ``rows``.

    The same draws, costs and comparison as the policy with the trackers'
    ``load(now)``, read from the rows: returns the position the policy
    would return for the same generator state. The row at that position
    has been used (its first use recorded). ``now`` must be finite.
    """
    n = len(rows)
    if n <= 1:
        if n and rows[0].updated == _INF:
            rows[0].updated = now
        return 0
    first = int(draw() * n)
    second = int(draw() * (n - 1))
    if second >= first:
        second += 1
    # The policy reads the second sample's load first. Both costs are the
    # formula of the module docs, written out; with no call in flight the
    # age floor and the factor (0 + 1) change nothing and are skipped.
    row = rows[second]
    gap = row.updated - now
    if gap < 0.0:
        cost = row.estimate * _exp(gap * row.rate)
        if cost < _MIN_ESTIMATE:
            cost = _MIN_ESTIMATE
    else:
        if gap == _INF:
            row.updated = now  # the first use
        cost = row.estimate
    busy = row.in_flight
    if busy:
        age = now - row.oldest
        if age > cost:
            cost = age
        cost *= busy + 1
    cost_second = cost
    row = rows[first]
    gap = row.updated - now
    if gap < 0.0:
        cost = row.estimate * _exp(gap * row.rate)
        if cost < _MIN_ESTIMATE:
            cost = _MIN_ESTIMATE
    else:
        if gap == _INF:
            row.updated = now  # the first use
        cost = row.estimate
    busy = row.in_flight
    if busy:
        age = now - row.oldest
        if age > cost:
            cost = age
        cost *= busy + 1
    if cost_second < cost:
        return second
    return first


def faded(row: Row, now: float) -> float:
    """The stored estimate faded by the time since it was set (no first use recorded)."""
    estimate: float = row.estimate
    gap = now - row.updated
    if gap > 0.0:
        estimate *= _exp(-gap * row.rate)
        if estimate < _MIN_ESTIMATE:
            estimate = _MIN_ESTIMATE
    return estimate


def start_call(row: Row, now: float) -> None:
    """Count a call started at ``now`` (the row has been used)."""
    k = row.in_flight
    row.in_flight = k + 1
    if row.floor:
        if not k:
            row.oldest = now
        else:
            also_started(row, now)


def also_started(row: Row, now: float) -> None:
    """A call started while others are in flight (age floor on): keep the starts sorted."""
    later: list[float] | None = row.later
    if later is None:
        later = row.later = []
    oldest = row.oldest
    if now < oldest:
        row.oldest = now
        later.insert(0, oldest)
    elif not later or now >= later[-1]:
        later.append(now)
    else:
        insort(later, now)


def end_in_flight(row: Row, started: float) -> None:
    """Stop counting a call started at ``started``; the oldest call moves on if it was it."""
    k = row.in_flight - 1
    row.in_flight = k
    if not k:
        row.oldest = _INF
    elif row.floor:
        one_ended(row, started)


def one_ended(row: Row, started: float) -> None:
    """One of several calls in flight ended (age floor on)."""
    later = row.later
    assert later
    if started == row.oldest:
        row.oldest = later.pop(0)
    else:
        del later[bisect_left(later, started)]


def complete_call(row: Row, started: float, now: float, failed: bool, penalty: float) -> None:
    """A call started at ``started`` completed at ``now``: the peak rule (see PeakEwma).

    ``now`` is finite and not before ``started`` (the caller checked).
    """
    rtt = now - started
    end_in_flight(row, started)
    estimate: float = row.estimate
    updated: float = row.updated
    # Completions may be reported slightly out of order; a negative gap
    # counts as no time at all (the prior keeps its full weight, unfaded).
    elapsed = now - updated
    weight = _exp(-elapsed * row.rate) if elapsed > 0.0 else 1.0
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
    row.estimate = estimate
    if now > updated:
        row.updated = now
    row.observations += 1


def cancel_call(row: Row, started: float, now: float, evidence: bool) -> None:
    """A call started at ``started`` was abandoned at ``now``; maybe raise the estimate."""
    end_in_flight(row, started)
    age = now - started
    if evidence and age > 0.0 and age > faded(row, now):
        # A call outstanding this long proves an RTT of at least its age:
        # raise the estimate as a completion of that age would.
        row.estimate = age
        if now > row.updated:
            row.updated = now
