"""Dispatch's flat path: a call on PeakEwma trackers starts and ends in the balance's table."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import anyio
import pytest

from poise import (
    Balance,
    Endpoint,
    InvalidInput,
    PeakEwma,
    PowerOfTwoChoices,
    service_fn,
)


async def _echo(request: object) -> object:
    return request


def _balance(
    *trackers: PeakEwma, clock: Callable[[], float] | None = None
) -> Balance[object, object]:
    eps: list[Endpoint[object, object]] = [
        Endpoint(f"k{i}", service_fn(_echo), tracker=tracker) for i, tracker in enumerate(trackers)
    ]
    if clock is None:
        return Balance(PowerOfTwoChoices(random.Random(1)), eps)
    return Balance(PowerOfTwoChoices(random.Random(1)), eps, clock=clock)


async def test_dispatch_on_peak_ewma_trackers_opens_no_guard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trackers = [PeakEwma(), PeakEwma()]
    balance = _balance(*trackers)

    def refuse(self: PeakEwma, now: float) -> None:
        raise AssertionError("the flat path opened a guard")

    monkeypatch.setattr(PeakEwma, "start", refuse)
    for i in range(10):
        assert await balance.dispatch(i) == i
    assert sum(t.observations for t in trackers) == 10
    assert all(t.in_flight == 0 for t in trackers)
    assert balance.statistics().in_flight == 0


def test_the_age_floor_follows_the_earliest_start_in_flight() -> None:
    tracker = PeakEwma(default_rtt=0.001)
    late = tracker.start(10.0)
    early = tracker.start(5.0)  # started later, at an earlier time
    # The oldest call in flight is the one that started at 5: age 15.
    assert tracker.load(20.0) == pytest.approx(15.0 * 3)
    early.cancel(20.0)
    assert tracker.load(20.0) == pytest.approx(max(10.0, tracker.estimate(20.0)) * 2)
    late.cancel(20.0)
    assert tracker.in_flight == 0


def _clock(times: list[float]) -> Iterator[float]:
    yield from times
    while True:
        yield times[-1]


@pytest.mark.parametrize("slow_start", [0.0, 5.0], ids=["flat path", "guard path"])
async def test_a_clock_that_goes_back_during_a_dispatch_leaves_no_call_in_flight(
    slow_start: float,
) -> None:
    tracker = PeakEwma(slow_start=slow_start)
    times = _clock([10.0, 4.0])
    balance = _balance(tracker, clock=lambda: next(times))
    with pytest.raises(InvalidInput, match="before"):
        await balance.dispatch("x")
    assert tracker.in_flight == 0
    assert tracker.observations == 0
    assert balance.statistics().in_flight == 0


async def test_a_dispatch_in_flight_when_its_endpoint_leaves_ends_on_its_own_tracker() -> None:
    release = anyio.Event()
    entered = anyio.Event()

    async def slow(request: object) -> object:
        entered.set()
        await release.wait()
        return request

    leaving_tracker = PeakEwma()
    balance: Balance[object, object] = Balance(
        PowerOfTwoChoices(random.Random(1)),
        [Endpoint("a", service_fn(slow), tracker=leaving_tracker)],
    )
    newcomer = PeakEwma(default_rtt=0.5)
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.dispatch, "x")
        await entered.wait()
        assert leaving_tracker.in_flight == 1
        balance.remove("a")
        balance.push(Endpoint("b", service_fn(_echo), tracker=newcomer))
        # The newcomer is READY in the place the leaving endpoint had: the
        # call must not end on its row.
        assert balance.ready_nowait() and balance._rrows == [newcomer._row]
        assert leaving_tracker.in_flight == 1
        release.set()
    assert leaving_tracker.in_flight == 0 and leaving_tracker.observations == 1
    assert newcomer.in_flight == 0 and newcomer.observations == 0
    assert newcomer.rtt_estimate == 0.5
    assert balance.statistics().in_flight == 0


async def test_a_cancelled_dispatch_leaves_no_call_in_flight_on_the_flat_path() -> None:
    entered = anyio.Event()

    async def hang(request: object) -> object:
        entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    tracker = PeakEwma()
    balance: Balance[object, object] = Balance(
        PowerOfTwoChoices(random.Random(1)),
        [Endpoint("a", service_fn(hang), tracker=tracker)],
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.dispatch, "x")
        await entered.wait()
        assert tracker.in_flight == 1
        tg.cancel_scope.cancel()
    assert tracker.in_flight == 0 and tracker.observations == 0
    assert balance.statistics().in_flight == 0


def _stuck_service() -> tuple[Callable[[object], Coroutine[Any, Any, object]], anyio.Event]:
    entered = anyio.Event()

    async def stuck(request: object) -> object:
        entered.set()
        await anyio.sleep_forever()
        return request

    return stuck, entered


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("slow_start", [0.0, 5.0], ids=["flat path", "guard path"])
async def test_a_cancelled_dispatch_ends_its_call_whatever_the_clock_reads(
    slow_start: float, bad: float
) -> None:
    """A clock that reads a time that is not finite when a call is cancelled:
    the cancellation goes on (no InvalidInput in its place), the call leaves
    no load in flight and proves nothing about the endpoint's latency."""
    tracker = PeakEwma(slow_start=slow_start, default_rtt=0.01)
    times = [10.0]
    stuck, entered = _stuck_service()
    balance: Balance[object, object] = Balance(
        PowerOfTwoChoices(random.Random(1)),
        [Endpoint("a", service_fn(stuck), tracker=tracker)],
        clock=lambda: times[-1],
    )
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(balance.dispatch, "x")
            await entered.wait()
            times.append(bad)
            scope.cancel()
    assert scope.cancelled_caught
    assert tracker.in_flight == 0
    assert balance.statistics().in_flight == 0
    # No evidence: the estimate is the default one, fading, never the bad time.
    assert 0.0 < tracker.estimate(20.0) <= 0.01


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("way", ["pick_held", "hold", "dispatch_held"])
async def test_a_held_call_cancelled_at_a_time_that_is_not_finite_still_ends(
    way: str, bad: float
) -> None:
    tracker = PeakEwma(default_rtt=0.01)
    times = [10.0]
    balance = _balance(tracker, clock=lambda: times[-1])
    if way == "pick_held":
        assert balance.ready_nowait()
        held: object = balance.pick_held("x")
    elif way == "hold":
        held = balance.hold("k0")
    else:
        held = await balance.dispatch_held("x")
    assert tracker.in_flight == 1
    times.append(bad)
    held.cancel()  # type: ignore[attr-defined]
    assert tracker.in_flight == 0
    assert balance.statistics().in_flight == 0
    # No evidence: the estimate is the default one, fading, never the bad time.
    assert 0.0 < tracker.estimate(20.0) <= 0.01
