"""Balance.dispatch_held / Held, and CallDeclined from every dispatch entry point."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import pytest

from poise import (
    Balance,
    CallDeclined,
    Endpoint,
    EndpointError,
    Held,
    InvalidInput,
    LoadGuard,
    PeakEwma,
    ReadinessState,
    SelectionError,
)

from ._balance_support import First, Fixed, Recorder, ctl, endpoints, state, until


def recorded(
    *names: str, policy: First | Fixed | None = None
) -> tuple[Balance[object, object], list[Endpoint[object, object]]]:
    """A balance (First policy by default) whose endpoints have Recorder trackers."""
    eps: list[Endpoint[object, object]] = []
    for ep in endpoints(*names):
        with_rec = ep.with_tracker(Recorder())
        ctl(with_rec).endpoint = with_rec
        eps.append(with_rec)
    return Balance(First() if policy is None else policy, eps), eps


def events(ep: Endpoint[object, object]) -> list[tuple[str, ...]]:
    tracker = ep.tracker
    assert isinstance(tracker, Recorder)
    return tracker.events


class Timed:
    """A tracker whose guards record the times they were given."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    def load(self, now: float) -> float:
        return 0.0

    def start(self, now: float) -> LoadGuard:
        self.times.append(("start", now))
        return _TimedGuard(self)


class _TimedGuard:
    def __init__(self, tracker: Timed) -> None:
        self.tracker = tracker

    def complete(self, now: float, *, failed: bool = False) -> None:
        self.tracker.times.append(("failed" if failed else "complete", now))

    def cancel(self, now: float) -> None:
        self.tracker.times.append(("cancel", now))


# -- the ordinary path ----------------------------------------------------------


async def test_dispatch_held_returns_the_response_with_the_guard_open() -> None:
    balance, (a, b) = recorded("a", "b", policy=Fixed(1))
    held = await balance.dispatch_held("x")
    assert isinstance(held, Held)
    assert held.response == ("b", "x")
    assert held.key == "b" and held.index == 1
    assert not held.ended
    assert events(b) == [("start",)] and events(a) == []
    assert b.load(0.0) == 1
    assert balance.statistics().in_flight == 1
    assert "'b'" in repr(held) and "open" in repr(held)
    held.complete()
    assert held.ended
    assert events(b) == [("start",), ("complete", "ok")]
    assert b.load(0.0) == 0
    assert balance.statistics().in_flight == 0
    assert "ended" in repr(held)


async def test_held_complete_failed_and_cancel_reach_the_guard() -> None:
    balance, (a,) = recorded("a")
    failed = await balance.dispatch_held("x")
    failed.complete(failed=True)
    cancelled = await balance.dispatch_held("y")
    cancelled.cancel()
    assert events(a) == [("start",), ("complete", "failed"), ("start",), ("cancel",)]
    assert balance.statistics().in_flight == 0


async def test_the_first_end_wins_and_later_ends_are_no_ops() -> None:
    balance, (a,) = recorded("a")
    first = await balance.dispatch_held("x")
    first.complete()
    first.cancel()
    first.complete(failed=True)
    second = await balance.dispatch_held("y")
    second.cancel()
    second.complete()
    second.cancel()
    assert events(a) == [("start",), ("complete", "ok"), ("start",), ("cancel",)]
    # The in-flight count went down once per call, not once per end.
    assert balance.statistics().in_flight == 0
    assert first.ended and second.ended


async def test_held_ends_with_the_balance_clock() -> None:
    now = [10.0]
    tracker = Timed()
    (ep,) = endpoints("a")
    balance: Balance[object, object] = Balance(
        First(), [ep.with_tracker(tracker)], clock=lambda: now[0]
    )
    held = await balance.dispatch_held("x")
    now[0] = 12.5
    held.complete()
    now[0] = 20.0
    held.cancel()  # a no-op: no third entry
    assert tracker.times == [("start", 10.0), ("complete", 12.5)]


async def test_pick_held_picks_and_guards_without_calling_the_service() -> None:
    balance, (a, b) = recorded("a", "b", policy=Fixed(1))
    with pytest.raises(SelectionError):
        balance.pick_held("x")  # no reservation yet
    assert balance.ready_nowait()
    held = balance.pick_held("x")
    assert held.response is b and held.key == "b" and held.index == 1
    assert ctl(b).calls == [] and ctl(a).calls == []  # no service was called
    assert events(b) == [("start",)] and balance.statistics().in_flight == 1
    held.complete(failed=True)
    assert events(b) == [("start",), ("complete", "failed")]
    assert balance.statistics().in_flight == 0


async def test_pick_held_starts_the_guard_at_a_reading_the_caller_hands_in() -> None:
    # A caller that just read the balance's clock (with nothing awaited
    # since) passes the reading; the scan and the pick then read none.
    readings = [0]
    now = [10.0]

    def clock() -> float:
        readings[0] += 1
        return now[0]

    tracker = Timed()
    (ep,) = endpoints("a")
    balance: Balance[object, object] = Balance(First(), [ep.with_tracker(tracker)], clock=clock)
    before = readings[0]
    assert balance.ready_nowait(9.5)
    held = balance.pick_held("x", 9.5)
    assert readings[0] == before  # neither read the clock
    held.complete()  # ends at the clock's own reading
    assert tracker.times == [("start", 9.5), ("complete", 10.0)]
    assert readings[0] == before + 1


async def test_hold_guards_a_named_endpoint_outside_the_pick() -> None:
    # Fixed(0) would pick "a"; hold names "b" and never consults the policy.
    balance, (a, b) = recorded("a", "b", policy=Fixed(0))
    held = balance.hold("b")
    assert held.key == "b" and held.index == 1 and held.response is None
    assert events(b) == [("start",)] and events(a) == []
    assert b.load(0.0) == 1 and balance.statistics().in_flight == 1
    held.complete(failed=True)
    held.cancel()  # the first end counts
    assert events(b) == [("start",), ("complete", "failed")]
    assert balance.statistics().in_flight == 0
    cancelled = balance.hold(0)  # by index too
    cancelled.cancel()
    assert events(a) == [("start",), ("cancel",)]
    assert balance.statistics().in_flight == 0
    with pytest.raises(InvalidInput, match="'c'"):
        balance.hold("c")


async def test_dispatch_held_waits_for_readiness_then_calls() -> None:
    balance, (a,) = recorded("a")
    ctl(a).mode = "pending"
    got: list[Held[object]] = []

    async def caller() -> None:
        got.append(await balance.dispatch_held("x"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await until(lambda: ctl(a).polls == 1)
        assert ctl(a).calls == []
        ctl(a).make_ready()
    assert got[0].response == ("a", "x")
    got[0].complete()
    assert events(a) == [("start",), ("complete", "ok")]


async def test_dispatch_held_on_an_empty_balance_is_a_selection_error() -> None:
    balance: Balance[object, object] = Balance(First())
    with pytest.raises(SelectionError):
        await balance.dispatch_held("x")


async def test_a_held_call_outlives_the_removal_of_its_endpoint() -> None:
    balance, (a, b) = recorded("a", "b")
    held = await balance.dispatch_held("x")
    balance.remove("a")
    assert b.index == 0
    assert balance.statistics().in_flight == 1
    held.complete()
    assert events(a) == [("start",), ("complete", "ok")]
    assert balance.statistics().in_flight == 0
    assert held.index == 0 and held.key == "a"


# -- errors and cancellation ------------------------------------------------------


async def test_dispatch_held_service_error_completes_failed_and_raises_endpoint_error() -> None:
    balance, (a, b) = recorded("a", "b", policy=Fixed(1))
    boom = OSError("reset")
    ctl(b).raise_on_call = boom
    with pytest.raises(EndpointError) as info:
        await balance.dispatch_held("x")
    assert info.value.index == 1 and info.value.key == "b"
    assert info.value.__cause__ is boom
    assert events(b) == [("start",), ("complete", "failed")] and events(a) == []
    assert balance.statistics().in_flight == 0


async def test_cancellation_during_the_held_call_cancels_the_guard() -> None:
    balance, (a,) = recorded("a")
    ctl(a).block = anyio.Event()
    got: list[Held[object]] = []

    async def caller() -> None:
        got.append(await balance.dispatch_held("x"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await until(lambda: ctl(a).calls == ["x"])
        assert balance.statistics().in_flight == 1
        tg.cancel_scope.cancel()
    assert got == []
    assert events(a) == [("start",), ("cancel",)]
    assert a.load(0.0) == 0
    assert balance.statistics().in_flight == 0


async def test_a_caller_cancelled_before_selection_starts_no_guard() -> None:
    balance, (a,) = recorded("a")
    ctl(a).mode = "pending"
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.dispatch_held, "x")
        await until(lambda: ctl(a).polls == 1)
        tg.cancel_scope.cancel()
    ctl(a).make_ready()
    assert events(a) == [] and ctl(a).calls == []
    assert balance.statistics().in_flight == 0


async def test_a_caller_cancelled_after_dispatch_leaves_the_held_call_open() -> None:
    balance, (a,) = recorded("a")
    handed: list[Held[object]] = []

    async def caller() -> None:
        held = await balance.dispatch_held("x")
        handed.append(held)
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await until(lambda: len(handed) == 1)
        tg.cancel_scope.cancel()
    (held,) = handed
    # The guard belongs to the Held, not to the task that dispatched.
    assert not held.ended
    assert events(a) == [("start",)]
    assert balance.statistics().in_flight == 1
    with anyio.CancelScope() as scope:
        scope.cancel()
        try:
            await anyio.lowlevel.checkpoint()
        finally:
            held.complete()  # synchronous: works in a cancelled scope and a finally
    assert scope.cancelled_caught
    assert events(a) == [("start",), ("complete", "ok")]
    assert balance.statistics().in_flight == 0


async def test_a_held_call_can_be_ended_from_another_task() -> None:
    balance, (a,) = recorded("a")
    send, receive = anyio.create_memory_object_stream[Held[object]](1)
    ended: list[bool] = []

    async def owner() -> None:
        async with receive:
            held = await receive.receive()
            held.cancel()
            ended.append(held.ended)

    async with anyio.create_task_group() as tg:
        tg.start_soon(owner)
        async with send:
            await send.send(await balance.dispatch_held("x"))
    assert ended == [True]
    assert events(a) == [("start",), ("cancel",)]
    assert balance.statistics().in_flight == 0


# -- CallDeclined -----------------------------------------------------------------


async def _via_call(balance: Balance[object, object]) -> object:
    await balance.ready()
    return await balance.call("x")


async def _via_dispatch(balance: Balance[object, object]) -> object:
    return await balance.dispatch("x")


async def _via_dispatch_held(balance: Balance[object, object]) -> object:
    return await balance.dispatch_held("x")


async def _via_open(balance: Balance[object, object]) -> object:
    async with balance.open("x") as response:
        raise AssertionError(f"the block ran with {response!r}")


ENTRY_POINTS: dict[str, Callable[[Balance[object, object]], Awaitable[object]]] = {
    "call": _via_call,
    "dispatch": _via_dispatch,
    "dispatch_held": _via_dispatch_held,
    "open": _via_open,
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
async def test_call_declined_cancels_the_guard_and_propagates_unchanged(entry: str) -> None:
    balance, (a,) = recorded("a")
    declined = CallDeclined("the instance was withdrawn")
    ctl(a).raise_on_call = declined
    with pytest.raises(CallDeclined) as info:
        await ENTRY_POINTS[entry](balance)
    assert info.value is declined  # not wrapped in EndpointError
    assert not isinstance(info.value, EndpointError)
    assert events(a) == [("start",), ("cancel",)]
    assert balance.statistics().in_flight == 0
    # Not blamed: no quarantine, and the endpoint serves the next call.
    assert state(a) is ReadinessState.IDLE and a.error is None
    ctl(a).raise_on_call = None
    assert await balance.dispatch("y") == ("a", "y")


class SlowDecline:
    """Always ready; each call takes one clock second and then declines."""

    def __init__(self, now: list[float]) -> None:
        self.now = now

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        return True

    async def call(self, request: object) -> object:
        self.now[0] += 1.0
        raise CallDeclined("not sent")


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
async def test_call_declined_records_no_round_trip_time(entry: str) -> None:
    now = [0.0]
    ewma = PeakEwma(default_rtt=0.030)
    ep: Endpoint[object, object] = Endpoint("a", SlowDecline(now), tracker=ewma)
    balance: Balance[object, object] = Balance(First(), [ep], clock=lambda: now[0])
    ewma.load(now[0])  # first use at t=0
    before = (ewma.rtt_estimate, ewma.updated_at)
    with pytest.raises(CallDeclined):
        await ENTRY_POINTS[entry](balance)
    assert now[0] == 1.0
    # A completed one-second call would have lifted the estimate to ~1 s, and
    # so would a cancellation one second old: the balance cancels a declined
    # call as of its dispatch time, which is no evidence.
    assert (ewma.rtt_estimate, ewma.updated_at) == before
    assert ewma.in_flight == 0


async def test_call_held_needs_a_reservation_and_adds_no_checkpoint() -> None:
    balance, (_, b) = recorded("a", "b", policy=Fixed(1))
    with pytest.raises(SelectionError):
        await balance.call_held("x")  # no readiness scan yet: no reservation
    assert balance.ready_nowait()
    with anyio.CancelScope() as scope:
        scope.cancel()
        # Already cancelled: a checkpoint would raise here; the hand-over has none.
        held = await balance.call_held("x")
    assert not scope.cancelled_caught
    assert held.response == ("b", "x") and held.key == "b" and not held.ended
    assert events(b) == [("start",)] and balance.statistics().in_flight == 1
    held.complete(failed=True)
    assert events(b) == [("start",), ("complete", "failed")]
    assert balance.statistics().in_flight == 0
