"""Passive outlier ejection: keep an endpoint that keeps failing out for a while.

:class:`OutlierDetector` watches the outcome of every call a
:class:`~poise.Balance` makes (Envoy's outlier detection, Finagle's failure
accrual) and *ejects* an endpoint that looks broken. It is a sans-IO
decision core: synchronous, keyed by endpoint key, and every method takes
the time as an argument; the balance feeds it and applies its decisions.

Per endpoint key::

    IN ──(consecutive_failures in a row, or failure_rate over a full window)──► EJECTED
     ▲                                                                            │
     └──────────── ejection time is up (checked by expire(now)) ─────────────────┘

Ejection rules
    * ``consecutive_failures`` (default 5; ``None`` = off): that many failed
      calls in a row, with no success in between.
    * ``failure_rate`` (default ``None`` = off): in a window of ``window``
      seconds with at least ``minimum_calls`` outcomes, the fraction of
      failures reaches ``failure_rate``. Windows are fixed (tumbling) and
      start at the first outcome after the previous window ended.
    * An ejection lasts ``base_ejection_time x k`` seconds, where ``k`` is
      the endpoint's ejection count including this one, capped at
      ``max_ejection_time``. ``k`` goes back to 0 after the endpoint has
      stayed in for ``max_ejection_time`` since its last return.
    * Never more than ``max_ejection_percent`` of the current members are
      ejected at once (rounded down): an ejection beyond the cap does not
      happen (the endpoint's counters restart). When members leave and the
      cap shrinks, the most recently ejected endpoints return early.
    * A returning endpoint starts with clean counters.
    * ``reinstate(key, now)`` ends one ejection early, at the first
      ``expire`` from ``now`` (a caller that learned the endpoint is back,
      such as a connection that succeeds again): it returns as a new
      member would, its next ejection lasting the base time again.

Only completed calls count (a success, or a failure: the service raised,
or a held response was completed as failed). Cancelled and declined calls
are no evidence either way.

Every ejection and every return is reported as an :class:`OutlierEvent` to
the ``observer`` (if any) and returned by the method that made it.

Cost: ``record`` is O(1) (O(log e) when it ejects, e = ejected endpoints);
``expire`` is O(1) when nothing is due and O(log e) per return.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from ._errors import InvalidInput

__all__ = ["OutlierDetector", "OutlierEvent", "OutlierObserver"]


@dataclass(frozen=True, slots=True)
class OutlierEvent:
    """One ejection (``ejected=True``) or return (``ejected=False``) of an endpoint.

    ``at`` is the time of the decision; for an ejection ``until`` is when it
    ends and ``ejections`` how many times in a row the endpoint was ejected
    (the multiplier of ``base_ejection_time``); ``reason`` is
    ``"consecutive failures"``, ``"failure rate"``, ``"expired"``,
    ``"cap"`` (returned early because the pool shrank), ``"removed"``,
    ``"exhausted"`` (returned early because nothing else was usable), or
    the reason given to :meth:`OutlierDetector.reinstate`.
    """

    key: Hashable
    ejected: bool
    at: float
    until: float
    ejections: int
    reason: str


OutlierObserver = Callable[[OutlierEvent], None]
"""Called as ``observer(event)`` for every ejection and return; must not raise."""


class _State:
    __slots__ = (
        "consecutive",
        "early",
        "ejected_at",
        "ejections",
        "failures",
        "returned_at",
        "seq",
        "total",
        "until",
        "window_start",
    )

    def __init__(self) -> None:
        self.consecutive = 0
        self.failures = 0
        self.total = 0
        self.window_start: float | None = None
        self.ejections = 0
        self.until: float | None = None  # not None while ejected
        self.ejected_at = 0.0
        self.returned_at: float | None = None
        self.seq = 0
        #: The reason of an early return asked for (reinstate), while ejected.
        self.early: str | None = None

    def clear_counters(self) -> None:
        self.consecutive = 0
        self.failures = 0
        self.total = 0
        self.window_start = None


def _number(name: str, value: object, *, low: float, inclusive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"OutlierDetector {name} must be a number, got {value!r}")
    number = float(value)
    ok = number >= low if inclusive else number > low
    if not (math.isfinite(number) and ok):
        sign = ">=" if inclusive else ">"
        raise InvalidInput(
            f"OutlierDetector {name} must be finite and {sign} {low:g}, got {value!r}"
        )
    return number


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInput(f"OutlierDetector {name} must be an int >= 1, got {value!r}")
    return value


def _finite_time(what: str, now: float) -> float:
    if type(now) is float and now - now == 0.0:  # the usual case: finite (inf - inf is nan)
        return now
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise InvalidInput(f"OutlierDetector.{what}: now must be a finite time, got {now!r}")
    return float(now)


class OutlierDetector:
    """Ejects endpoints whose calls keep failing; they return by themselves.

    See the module documentation for the rules. Give one to
    ``Balance(..., outlier_detector=...)``; a detector serves one balance.
    Every parameter is checked here (:class:`~poise.InvalidInput`), and at
    least one of ``consecutive_failures`` and ``failure_rate`` must be on.
    """

    __slots__ = (
        "_base",
        "_consecutive",
        "_due",
        "_ejected",
        "_max_percent",
        "_max_time",
        "_minimum",
        "_observer",
        "_rate",
        "_states",
        "_window",
    )

    def __init__(
        self,
        *,
        consecutive_failures: int | None = 5,
        failure_rate: float | None = None,
        window: float = 10.0,
        minimum_calls: int = 10,
        base_ejection_time: float = 30.0,
        max_ejection_time: float = 300.0,
        max_ejection_percent: float = 10.0,
        observer: OutlierObserver | None = None,
    ) -> None:
        self._consecutive = (
            None
            if consecutive_failures is None
            else _count("consecutive_failures", consecutive_failures)
        )
        if failure_rate is None:
            self._rate: float | None = None
        else:
            rate = _number("failure_rate", failure_rate, low=0.0)
            if rate > 1.0:
                raise InvalidInput(
                    f"OutlierDetector failure_rate must be <= 1, got {failure_rate!r}"
                )
            self._rate = rate
        if self._consecutive is None and self._rate is None:
            raise InvalidInput(
                "OutlierDetector needs consecutive_failures or failure_rate (both are off)"
            )
        self._window = _number("window", window, low=0.0)
        self._minimum = _count("minimum_calls", minimum_calls)
        self._base = _number("base_ejection_time", base_ejection_time, low=0.0)
        self._max_time = _number("max_ejection_time", max_ejection_time, low=0.0)
        if self._max_time < self._base:
            raise InvalidInput(
                f"OutlierDetector max_ejection_time ({max_ejection_time!r}) must be >= "
                f"base_ejection_time ({base_ejection_time!r})"
            )
        percent = _number("max_ejection_percent", max_ejection_percent, low=0.0, inclusive=True)
        if percent > 100.0:
            raise InvalidInput(
                f"OutlierDetector max_ejection_percent must be <= 100, got {max_ejection_percent!r}"
            )
        self._max_percent = percent
        if observer is not None and not callable(observer):
            raise InvalidInput("OutlierDetector observer must be callable")
        self._observer = observer
        self._states: dict[Hashable, _State] = {}
        # Ejected keys in ejection order (the newest last), and a heap of
        # (until, seq, key) for expiry; stale heap entries are skipped.
        self._ejected: dict[Hashable, None] = {}
        self._due: list[tuple[float, int, Hashable]] = []

    # -- read-only view ---------------------------------------------------------

    @property
    def members(self) -> int:
        return len(self._states)

    @property
    def ejected(self) -> tuple[Hashable, ...]:
        """The keys ejected now, oldest ejection first."""
        return tuple(self._ejected)

    def is_ejected(self, key: Hashable) -> bool:
        return key in self._ejected

    def ejected_until(self, key: Hashable) -> float | None:
        state = self._states.get(key)
        return None if state is None else state.until

    def ejections(self, key: Hashable) -> int:
        """The ejection count of ``key`` at its last ejection (its multiplier; 0: never)."""
        state = self._states.get(key)
        return 0 if state is None else state.ejections

    @property
    def capacity(self) -> int:
        """How many members may be ejected at once: floor(members x percent / 100)."""
        return int(len(self._states) * self._max_percent / 100.0 + 1e-9)

    def next_due(self) -> float:
        """The earliest time an ejection may end (``inf`` when none is pending)."""
        due = self._due
        while due:
            until, seq, key = due[0]
            state = self._states.get(key)
            if state is not None and state.until is not None and state.seq == seq:
                return until
            heapq.heappop(due)
        return math.inf

    # -- membership -----------------------------------------------------------

    def add(self, key: Hashable) -> None:
        """Start watching ``key`` (no-op if already a member)."""
        if key not in self._states:
            self._states[key] = _State()

    def reinstate(self, key: Hashable, now: float, reason: str = "reinstated") -> bool:
        """End the ejection of ``key`` at the first :meth:`expire` from
        ``now`` (:meth:`next_due` says so), with ``reason``; False when
        ``key`` is not ejected. The key returns as a new member would:
        clean counters, and its next ejection lasts the base time again.
        The other ejections keep their time. O(log e)."""
        now = _finite_time("reinstate", now)
        state = self._states.get(key)
        if state is None or state.until is None:
            return False
        state.early = reason
        if state.until > now:
            state.until = now
            state.seq += 1
            heapq.heappush(self._due, (now, state.seq, key))
        return True

    def remove(self, key: Hashable, now: float) -> list[OutlierEvent]:
        """Stop watching ``key``; an ejection of it ends ("removed")."""
        now = _finite_time("remove", now)
        state = self._states.pop(key, None)
        events: list[OutlierEvent] = []
        if state is not None and state.until is not None:
            del self._ejected[key]
            events.append(OutlierEvent(key, False, now, now, state.ejections, "removed"))
        events += self._enforce_cap(now)
        self._emit(events)
        return events

    def sync(self, keys: Iterable[Hashable], now: float) -> list[OutlierEvent]:
        """Make the members exactly ``keys``: new ones are added, others removed."""
        now = _finite_time("sync", now)
        wanted = dict.fromkeys(keys)
        events: list[OutlierEvent] = []
        for key in [key for key in self._states if key not in wanted]:
            state = self._states.pop(key)
            if state.until is not None:
                del self._ejected[key]
                events.append(OutlierEvent(key, False, now, now, state.ejections, "removed"))
        for key in wanted:
            self.add(key)
        events += self._enforce_cap(now)
        self._emit(events)
        return events

    # -- evidence and time ---------------------------------------------------------

    def record(self, key: Hashable, failed: bool, now: float) -> OutlierEvent | None:
        """Count one completed call of ``key``; return the ejection it caused, if any.

        Outcomes of an ejected endpoint (calls dispatched before its ejection)
        and of unknown keys are ignored.
        """
        state = self._states.get(key)
        if state is None or state.until is not None:
            return None
        now = _finite_time("record", now)
        reason: str | None = None
        if failed:
            state.consecutive += 1
            if self._consecutive is not None and state.consecutive >= self._consecutive:
                reason = "consecutive failures"
        else:
            state.consecutive = 0
        if self._rate is not None:
            start = state.window_start
            if start is None or now - start >= self._window:
                state.window_start = now
                state.failures = 0
                state.total = 0
            state.total += 1
            state.failures += failed
            if (
                reason is None
                and state.total >= self._minimum
                and state.failures >= self._rate * state.total
            ):
                reason = "failure rate"
        if reason is None:
            return None
        return self._eject(key, state, now, reason)

    def expire(self, now: float) -> list[OutlierEvent]:
        """End every ejection whose time is up at ``now``; return the returns."""
        now = _finite_time("expire", now)
        events: list[OutlierEvent] = []
        due = self._due
        states = self._states
        while due and due[0][0] <= now:
            _, seq, key = heapq.heappop(due)
            state = states.get(key)
            if state is None or state.until is None or state.seq != seq:
                continue
            events.append(self._return(key, state, now, "expired"))
        self._emit(events)
        return events

    def release_all(self, now: float) -> list[OutlierEvent]:
        """End every ejection at once ("exhausted": nothing else is usable)."""
        now = _finite_time("release_all", now)
        events = [
            self._return(key, self._states[key], now, "exhausted") for key in list(self._ejected)
        ]
        self._emit(events)
        return events

    # -- internals ----------------------------------------------------------------

    def _eject(self, key: Hashable, state: _State, now: float, reason: str) -> OutlierEvent | None:
        state.clear_counters()
        if len(self._ejected) >= self.capacity:
            return None
        if state.returned_at is not None and now - state.returned_at >= self._max_time:
            state.ejections = 0
        state.ejections += 1
        until = now + min(self._base * state.ejections, self._max_time)
        state.until = until
        state.ejected_at = now
        state.seq += 1
        self._ejected[key] = None
        heapq.heappush(self._due, (until, state.seq, key))
        event = OutlierEvent(key, True, now, until, state.ejections, reason)
        self._emit([event])
        return event

    def _return(self, key: Hashable, state: _State, now: float, reason: str) -> OutlierEvent:
        state.until = None
        state.returned_at = now
        state.clear_counters()
        del self._ejected[key]
        event = OutlierEvent(key, False, now, now, state.ejections, reason)
        early = state.early
        if early is not None:
            state.early = None
            if reason == "expired":
                # The early return reinstate() asked for: it starts over.
                event = OutlierEvent(key, False, now, now, state.ejections, early)
                state.ejections = 0
                state.returned_at = None
        return event

    def _enforce_cap(self, now: float) -> list[OutlierEvent]:
        events: list[OutlierEvent] = []
        capacity = self.capacity
        while len(self._ejected) > capacity:
            key = next(reversed(self._ejected))
            events.append(self._return(key, self._states[key], now, "cap"))
        return events

    def _emit(self, events: list[OutlierEvent]) -> None:
        observer = self._observer
        if observer is not None:
            for event in events:
                observer(event)

    def __repr__(self) -> str:
        return (
            f"<OutlierDetector members={len(self._states)} ejected={len(self._ejected)} "
            f"capacity={self.capacity}>"
        )
