"""A latency-aware load tracker: peak-sensitive EWMA of the round-trip time.

:class:`PeakEwma` is the load metric of the Finagle / Tower / Linkerd
balancer. It keeps one stored estimate of the round-trip time (RTT), ``E``,
with the time ``u`` it was last updated, and reports a cost that grows with
the *current* estimate and with the calls in flight::

    estimate(now) = E x exp(-(now - u) / decay)           (fades without evidence)
    cost(now)     = max(estimate(now), age of the oldest call in flight)
                    x (in_flight + 1) [x slow-start multiplier]

Recovery
    Without new evidence the estimate fades toward zero with the time
    constant ``decay``, exactly as Tower's PeakEwma decays its estimate on
    every read, but computed as a pure function of ``(state, now)``: the
    cost does not depend on how often a policy looks. An endpoint whose
    estimate was raised by a slow or failed second is therefore not shut out
    for good: its cost falls until it is below its peers', it is picked,
    and its next answers measure it afresh. After a peak of ``p`` seconds
    among peers costing ``c``, the first probe comes about
    ``decay x ln(p / c)`` seconds later (2 s among 20 ms peers with the
    default 10 s: about 46 s).

Observations (``guard.complete``) follow the *peak* rule, against the
current estimate ``e = estimate(now)``::

    rtt > e      E = rtt                                 (jump up at once)
    otherwise    w = exp(-(now - u) / decay)
                 E = e*w + rtt*(1-w)                     (blend toward rtt)
    and in both cases u = now.

A latency spike is believed at once; the blend gives new evidence the more
weight the longer the endpoint went unmeasured.

Fairness at low load
    With little traffic the in-flight factor is mostly 1, so P2C compares
    bare estimates and always prefers the lower one. Without the fade, an
    endpoint whose estimate a noisy answer had raised lost every comparison
    and was seldom measured again, so its deviation persisted and identical
    backends got shares spread wider than a plain EWMA gives them.
    The fade is the restoring force: an endpoint that is passed over gets
    cheaper until it is picked again (see ``benchmarks/balancer_recovery.py``).

The age floor (``age_floor=True``, the default)
    A call that has been in flight for ``a`` seconds proves the endpoint's
    RTT is at least ``a`` *now*, before the call ends (``a`` is the age of
    the call with the earliest start among those in flight). Without this bound an
    endpoint that stops answering (a black hole) never produces a slow
    observation, and its cost grows only with its in-flight count, so it
    keeps receiving traffic. The floor only raises the cost while such a
    call is outstanding. ``age_floor=False`` gives the classic metric.

Cancelled calls are evidence (``cancel_evidence=True``, the default)
    ``guard.cancel(now)`` of a call outstanding for ``a`` seconds, with
    ``a`` above the current estimate, raises the estimate to ``a``, as a
    completion of that age would (a client timeout proves the endpoint took
    at least that long). A cancelled call younger than the estimate changes
    nothing: abandoning it says nothing about the endpoint's speed.
    Cancellations are not counted in ``observations``.
    ``cancel_evidence=False`` makes every cancellation evidence-free.

Endpoints without history
    The stored estimate starts at ``default_rtt`` (30 ms, as in Linkerd),
    fading like any other from the tracker's first use.

Failures
    A failed call (``complete(now, failed=True)``) never lowers the estimate:
    it sets ``E = max(rtt, failure_penalty, min(2 e, cap))`` with
    ``cap = max(rtt, 10 x failure_penalty)`` and ``e = estimate(now)``. So a
    failure counts as at least the penalty, and each further failure doubles
    the estimate (up to ten penalties): an endpoint that fails fast must not
    look fast, not even beside peers slower than the penalty, while the cap
    bounds the time the fade needs to let it be probed again (from 10 s
    among 20 ms peers, about 62 s with the default decay).
    ``failure_penalty=0`` measures failures like successes.

Slow start (off by default)
    With ``slow_start=W`` seconds the cost is multiplied by a factor that
    starts at ``slow_start_scale`` and falls linearly to 1 over the first
    ``W`` seconds after the tracker's first use (the first ``now`` it sees).

Guard lifecycle::

    tracker.start(now) ──► guard               in_flight += 1
    guard.complete(now[, failed])  ─┐ first:   in_flight -= 1, observe RTT
    guard.cancel(now)              ─┘ first:   in_flight -= 1, raise E to the
                                               call's age if it exceeds estimate(now)
                                      later:   no-op

Time is always passed in (seconds on the event-loop clock); the tracker never
reads a clock. ``load`` is a pure function of the state and ``now`` (it only
records the first ``now`` it sees, for slow start and the fade).

Where the state lives
    The numbers (stored estimate, its time, calls in flight, oldest call in
    flight, observations) sit in one small record, the tracker's *row* (see
    ``poise._flat``). A :class:`~poise.Balance` reads and edits the rows of
    its endpoints' trackers in place when it picks and dispatches, so the
    tracker and the balance never hold two copies of one number.

Cost: ``start`` allocates one small guard; ``load``, ``complete`` and
``cancel`` are O(1) (one ``exp`` each) while at most one call is in flight,
and add a C-level list insertion or deletion of O(calls in flight) with
more. A call that ``Balance.dispatch`` makes opens no guard at all.
"""

from __future__ import annotations

import math

from ._errors import InvalidInput
from ._flat import _INF, _MIN_ESTIMATE, Row, cancel_call, complete_call, faded, new_row, start_call

__all__ = ["PeakEwma", "PeakEwmaGuard"]

_exp = math.exp
_new_guard = object.__new__


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"PeakEwma {name} must be a number of seconds, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0.0):
        raise InvalidInput(f"PeakEwma {name} must be finite and > 0, got {value!r}")
    return value


def _non_negative(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"PeakEwma {name} must be a number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        raise InvalidInput(f"PeakEwma {name} must be finite and >= 0, got {value!r}")
    return value


def _time(what: str, now: float) -> float:
    # `now - now != 0.0` is True exactly for NaN and the infinities, and is
    # cheaper than a call on the hot path.
    if now - now != 0.0:
        raise InvalidInput(f"{what}: now must be a finite time, got {now!r}")
    return now


def row_of(tracker: object) -> Row | None:
    """The row a balance may pick and dispatch on (see poise._flat), or None.

    A ``PeakEwma`` without slow start: its row says its whole cost.
    """
    if type(tracker) is PeakEwma and tracker._slow_start == 0.0:
        return tracker._row
    return None


class PeakEwma:
    """Peak-sensitive EWMA of the RTT times the calls in flight (lower is better).

    ``default_rtt`` (seconds, default 0.030) is the estimate before the first
    observation; ``decay`` (seconds, default 10.0) is the time constant with
    which the estimate recovers after a peak. ``failure_penalty`` (seconds,
    default 1.0) is the least RTT a failed call counts as. ``slow_start``
    (seconds, default 0 = off) is the ramp-up window for a new endpoint and
    ``slow_start_scale`` (default 10.0) the cost multiplier at its start.
    ``age_floor`` (default True) lets the age of the oldest call in flight
    raise the estimate while that call lasts, and ``cancel_evidence``
    (default True) lets a cancelled call older than the estimate raise it
    (see the module docs). Without evidence the estimate fades toward zero
    with the time constant ``decay``.
    Every parameter is checked here; a bad one raises :class:`InvalidInput`.
    """

    __slots__ = (
        "_age_floor",
        "_cancel_evidence",
        "_decay",
        "_default_rtt",
        "_epoch",
        "_failure_penalty",
        "_rate",
        "_row",
        "_slow_start",
        "_slow_start_scale",
    )

    def __init__(
        self,
        default_rtt: float = 0.030,
        decay: float = 10.0,
        *,
        failure_penalty: float = 1.0,
        slow_start: float = 0.0,
        slow_start_scale: float = 10.0,
        age_floor: bool = True,
        cancel_evidence: bool = True,
    ) -> None:
        self._default_rtt = _positive("default_rtt", default_rtt)
        self._decay = _positive("decay", decay)
        self._failure_penalty = _non_negative("failure_penalty", failure_penalty)
        self._slow_start = _non_negative("slow_start", slow_start)
        self._slow_start_scale = _positive("slow_start_scale", slow_start_scale)
        if self._slow_start_scale < 1.0:
            raise InvalidInput(
                f"PeakEwma slow_start_scale must be >= 1 (a cost multiplier), "
                f"got {slow_start_scale!r}"
            )
        if not isinstance(age_floor, bool):
            raise InvalidInput(f"PeakEwma age_floor must be a bool, got {age_floor!r}")
        self._age_floor = age_floor
        if not isinstance(cancel_evidence, bool):
            raise InvalidInput(f"PeakEwma cancel_evidence must be a bool, got {cancel_evidence!r}")
        self._cancel_evidence = cancel_evidence
        self._rate = 1.0 / self._decay
        # The first now seen (the start of the slow-start window).
        self._epoch: float | None = None
        # The whole state (see poise._flat); balances read and edit it in place.
        self._row = new_row(self._default_rtt, self._rate, age_floor)

    # -- read-only view -------------------------------------------------------

    @property
    def default_rtt(self) -> float:
        return self._default_rtt

    @property
    def decay(self) -> float:
        return self._decay

    @property
    def failure_penalty(self) -> float:
        return self._failure_penalty

    @property
    def slow_start(self) -> float:
        return self._slow_start

    @property
    def slow_start_scale(self) -> float:
        return self._slow_start_scale

    @property
    def age_floor(self) -> bool:
        return self._age_floor

    @property
    def cancel_evidence(self) -> bool:
        return self._cancel_evidence

    @property
    def in_flight(self) -> int:
        """Calls started and not yet completed or cancelled."""
        return self._row.in_flight

    @property
    def rtt_estimate(self) -> float:
        """The stored RTT estimate ``E`` in seconds, as of the last evidence.

        ``default_rtt`` before any evidence. What the cost uses is
        :meth:`estimate`, this value faded by the time since.
        """
        return self._row.estimate

    @property
    def updated_at(self) -> float | None:
        """When the stored estimate was last set (``None`` before the first use)."""
        updated: float = self._row.updated
        return None if updated == _INF else updated

    def estimate(self, now: float) -> float:
        """The RTT estimate at ``now``: the stored one faded by the time since.

        Pure: reading it changes nothing (beyond recording the first use).
        """
        if now - now != 0.0:
            _time("PeakEwma.estimate", now)
        row = self._row
        if row.updated == _INF:
            self._first_use(now)
        return faded(row, now)

    @property
    def observations(self) -> int:
        """How many completed calls (successful or failed) have been observed."""
        return self._row.observations

    # -- the LoadTracker protocol ----------------------------------------------

    def load(self, now: float) -> float:
        """``max(estimate, oldest call's age) x (in_flight + 1)`` x slow-start multiplier.

        O(1), no allocation. The first call records ``now`` as the start of the
        slow-start window.
        """
        if now - now != 0.0:
            _time("PeakEwma.load", now)
        row = self._row
        gap = row.updated - now
        if gap < 0.0:
            estimate = row.estimate * _exp(gap * row.rate)
            if estimate < _MIN_ESTIMATE:
                estimate = _MIN_ESTIMATE
        else:
            if gap == _INF:
                self._first_use(now)
            estimate = row.estimate
        age = now - row.oldest
        if age > estimate:
            estimate = age
        cost: float = estimate * (row.in_flight + 1)
        if self._slow_start > 0.0:
            age = now - self._epoch  # type: ignore[operator]
            if age < self._slow_start:
                remaining = 1.0 - max(age, 0.0) / self._slow_start
                cost *= 1.0 + (self._slow_start_scale - 1.0) * remaining
        return cost

    def start(self, now: float) -> PeakEwmaGuard:
        """Count one dispatched call and return the guard that will end it."""
        if now - now != 0.0:
            _time("PeakEwma.start", now)
        row = self._row
        if row.updated == _INF:
            self._first_use(now)
        start_call(row, now)
        # The guard's __init__, inlined (no Python frame): once per call.
        guard = _new_guard(PeakEwmaGuard)
        guard._tracker = self
        guard._started_at = now
        return guard

    # -- internals ------------------------------------------------------------

    def _first_use(self, now: float) -> None:
        self._row.updated = now
        if self._epoch is None:
            self._epoch = now

    def __repr__(self) -> str:
        return (
            f"<PeakEwma rtt_estimate={self.rtt_estimate * 1e3:.3f}ms "
            f"in_flight={self.in_flight} observations={self.observations} "
            f"decay={self._decay}s>"
        )


class PeakEwmaGuard:
    """The guard of one call measured by a :class:`PeakEwma` tracker.

    The first of ``complete`` / ``cancel`` counts; any later call is a no-op.
    ``cancel`` of a call older than the tracker's current estimate raises
    the estimate to the call's age (unless the tracker has
    ``cancel_evidence=False``).
    A ``now`` that is not finite, or earlier than the call's start (a negative
    RTT), raises :class:`InvalidInput` and leaves the guard open.
    """

    __slots__ = ("_started_at", "_tracker")

    def __init__(self, tracker: PeakEwma, started_at: float) -> None:
        self._tracker: PeakEwma | None = tracker
        self._started_at = started_at

    @property
    def ended(self) -> bool:
        return self._tracker is None

    @property
    def started_at(self) -> float:
        return self._started_at

    def complete(self, now: float, *, failed: bool = False) -> None:
        tracker = self._tracker
        if tracker is None:
            return
        if now - now != 0.0:
            _time("PeakEwmaGuard.complete", now)
        if now < self._started_at:
            raise InvalidInput(
                f"PeakEwmaGuard.complete: now={now!r} is before the call started "
                f"at {self._started_at!r} (negative RTT)"
            )
        self._tracker = None
        complete_call(tracker._row, self._started_at, now, failed, tracker._failure_penalty)

    def cancel(self, now: float) -> None:
        tracker = self._tracker
        if tracker is None:
            return
        if now - now != 0.0:
            _time("PeakEwmaGuard.cancel", now)
        self._tracker = None
        cancel_call(tracker._row, self._started_at, now, tracker._cancel_evidence)

    def __repr__(self) -> str:
        state = "ended" if self._tracker is None else "open"
        return f"<PeakEwmaGuard {state} started_at={self._started_at!r}>"
