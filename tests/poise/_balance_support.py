"""Controllable services, trackers and policies for the balance tests."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

import anyio
import anyio.lowlevel

from poise import Balance, Endpoint, LoadGuard, PeakEwma, ReadinessState, Weighted


class Ctl:
    """A service whose readiness and calls the test controls.

    ``mode`` is what ``poll_ready`` does: "ready", "pending" (remember the
    wake) or "fail" (raise ``error``). Like a real service, it calls the
    remembered wakes whenever its mode changes away from "pending" (its
    readiness may have changed). The service counts its reservations so
    a test can see that the balance never polls a READY endpoint twice and
    returns reservations it drops.
    """

    def __init__(self, name: str = "", mode: str = "ready") -> None:
        self.name = name
        self._mode = mode
        self.error: Exception = OSError(f"{name} is down")
        self.polls = 0
        self.wakes: list[Callable[[], None]] = []
        self.reserved = 0
        self.released = 0
        self.calls: list[object] = []
        self.block: anyio.Event | None = None
        self.raise_on_call: Exception | None = None
        self.observed_load: list[float] = []
        self.endpoint: Endpoint[object, object] | None = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        was, self._mode = self._mode, value
        if was == "pending" and value != "pending":
            wakes, self.wakes = self.wakes, []
            for wake in wakes:
                wake()

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        self.polls += 1
        assert self.reserved == 0, f"{self.name}: polled while holding a reservation"
        if self.mode == "fail":
            raise self.error
        if self.mode == "pending":
            self.wakes.append(wake)
            return False
        self.reserved += 1
        return True

    def release_reservation(self) -> None:
        assert self.reserved == 1
        self.reserved -= 1
        self.released += 1

    def make_ready(self) -> None:
        self.mode = "ready"

    async def call(self, request: object) -> object:
        assert self.reserved == 1, f"{self.name}: called without a reservation"
        self.reserved -= 1
        self.calls.append(request)
        if self.endpoint is not None:
            self.observed_load.append(self.endpoint.load(0.0))
        if self.block is not None:
            await self.block.wait()
        if self.raise_on_call is not None:
            raise self.raise_on_call
        return (self.name, request)


class Recorder:
    """A tracker that records its guards' events and reports a set load."""

    def __init__(self, load: float = 0.0) -> None:
        self.fixed = load
        self.events: list[tuple[str, ...]] = []
        self.open = 0

    def load(self, now: float) -> float:
        return self.fixed + self.open

    def start(self, now: float) -> LoadGuard:
        self.events.append(("start",))
        self.open += 1
        return _RecGuard(self)


class _RecGuard:
    def __init__(self, tracker: Recorder) -> None:
        self.tracker = tracker
        self.done = False

    def complete(self, now: float, *, failed: bool = False) -> None:
        if not self.done:
            self.done = True
            self.tracker.open -= 1
            self.tracker.events.append(("complete", "failed" if failed else "ok"))

    def cancel(self, now: float) -> None:
        if not self.done:
            self.done = True
            self.tracker.open -= 1
            self.tracker.events.append(("cancel",))


class First:
    """A policy that picks the first ready endpoint and records what it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[Hashable], object]] = []

    def pick(self, ready: Sequence[Weighted], context: object, now: float) -> int:
        self.seen.append(([ep.key for ep in ready], context))
        return 0


class Fixed:
    """A policy that always returns one index (possibly out of range)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def pick(self, ready: Sequence[Weighted], context: object, now: float) -> int:
        return self.index


def endpoints(*names: str, mode: str = "ready") -> list[Endpoint[object, object]]:
    out: list[Endpoint[object, object]] = []
    for name in names:
        svc = Ctl(name, mode)
        ep: Endpoint[object, object] = Endpoint(name, svc)
        svc.endpoint = ep
        out.append(ep)
    return out


def ctl(ep: Endpoint[object, object]) -> Ctl:
    svc = ep.service
    assert isinstance(svc, Ctl)
    return svc


def state(ep: Endpoint[object, object]) -> ReadinessState:
    """The state, read through a call (so type narrowing does not stick)."""
    return ep.state


def states(balance: Balance[object, object]) -> dict[Hashable, str]:
    return {ep.key: ep.state.value for ep in balance.endpoints}


async def until(predicate: Callable[[], bool]) -> None:
    """Yield to other tasks until ``predicate()`` holds."""
    for _ in range(1000):
        if predicate():
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError("condition never became true")


def assert_flat_mirrors(balance: Balance[object, object]) -> None:
    """The balance's rows are its endpoints' trackers' rows, and each row is consistent.

    The ready rows follow the ready list, each the very row of that
    endpoint's tracker (None for a tracker without one: another kind, or a
    PeakEwma with slow start); the unbound count is the number of endpoints
    without a row. A row says what its tracker says (estimate, last update,
    calls in flight, observations, decay rate, age floor), and with the age
    floor it keeps the oldest call's start in ``oldest`` and the others'
    starts, sorted, in ``later`` (infinite and empty when nothing is in
    flight, or without the age floor).
    """
    members = list(balance.endpoints)
    assert len(balance._rrows) == len(balance._ready)
    assert all(row is ep._row for row, ep in zip(balance._rrows, balance._ready, strict=True))
    unbound = 0
    for ep in members:
        tracker = ep.tracker
        row = ep._row
        if not isinstance(tracker, PeakEwma) or tracker.slow_start > 0.0:
            assert row is None
            unbound += 1
            continue
        assert row is tracker._row
        estimate, updated, in_flight, oldest = row.estimate, row.updated, row.in_flight, row.oldest
        rate, observations, floor, later = row.rate, row.observations, row.floor, row.later
        assert (estimate, in_flight, observations) == (
            tracker.rtt_estimate,
            tracker.in_flight,
            tracker.observations,
        )
        assert updated == (math.inf if tracker.updated_at is None else tracker.updated_at)
        assert rate == 1.0 / tracker.decay and floor == tracker.age_floor
        assert estimate > 0.0 and in_flight >= 0
        later = later or []
        if tracker.age_floor and in_flight:
            assert len(later) == in_flight - 1
            assert later == sorted(later) and all(start >= oldest for start in later)
            assert math.isfinite(oldest)
        else:
            assert oldest == math.inf and not later
    assert balance._unbound == unbound
