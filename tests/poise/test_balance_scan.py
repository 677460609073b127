"""Scans cost only what can be picked: drained endpoints leave, pending ones park."""

from __future__ import annotations

import random
from collections.abc import Callable

import anyio
import pytest

from poise import (
    Balance,
    ConcurrencyLimit,
    Endpoint,
    InvalidInput,
    PeakEwma,
    PowerOfTwoChoices,
    ReadinessState,
    service_fn,
)

from ._balance_support import First, ctl, endpoints


class Counting:
    """Always-ready or pending on demand; counts its polls; never wakes by itself."""

    def __init__(self, ready: bool = True) -> None:
        self.ready = ready
        self.polls = 0
        self.wake: Callable[[], None] | None = None

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        self.polls += 1
        self.wake = wake
        return self.ready

    async def call(self, request: object) -> object:
        return request


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_drained_endpoints_are_not_walked_by_the_scan() -> None:
    services = [Counting() for _ in range(1000)]
    eps = [Endpoint(i, s, eligible=i < 3) for i, s in enumerate(services)]
    balance: Balance[object, object] = Balance(First(), eps, clock=Clock())
    assert balance.ready_nowait()
    assert sum(s.polls for s in services) == 3
    assert len(balance._idle) == 0  # the 997 drained ones are in no scan list
    assert balance.statistics().ineligible == 997


async def test_a_drained_endpoint_returns_when_eligible_again() -> None:
    services = [Counting() for _ in range(3)]
    eps = [Endpoint(i, s) for i, s in enumerate(services)]
    balance: Balance[object, object] = Balance(First(), eps)
    assert balance.ready_nowait()
    eps[0].eligible = False
    assert eps[0].state is ReadinessState.IDLE
    assert await balance.dispatch("x") == "x"
    assert services[0].polls == 1  # never polled while drained
    eps[0].eligible = True
    assert balance.ready_nowait()
    assert services[0].polls == 2
    assert eps[0].state.value == "ready"
    # Draining and undraining twice in a row does not list it twice.
    eps[0].eligible = False
    eps[0].eligible = True
    eps[0].eligible = True
    assert balance._idle.count(eps[0]) == 1


def test_a_pending_endpoint_is_polled_again_only_after_its_wake() -> None:
    clock = Clock()
    ready, pending = Counting(), Counting(ready=False)
    balance: Balance[object, object] = Balance(
        First(), [Endpoint("r", ready), Endpoint("p", pending)], clock=clock
    )
    for _ in range(10):
        assert balance.ready_nowait()
    assert pending.polls == 1
    assert balance.statistics().pending == 1
    assert pending.wake is not None
    pending.ready = True
    pending.wake()
    assert balance.ready_nowait()
    assert pending.polls == 2
    assert balance.statistics().pending == 0


def test_a_pending_endpoint_that_never_wakes_is_rechecked_after_pending_recheck() -> None:
    clock = Clock()
    ready, silent = Counting(), Counting(ready=False)
    balance: Balance[object, object] = Balance(
        First(), [Endpoint("r", ready), Endpoint("s", silent)], clock=clock, pending_recheck=2.0
    )
    assert balance.ready_nowait()
    clock.now = 1.99
    assert balance.ready_nowait()
    assert silent.polls == 1
    clock.now = 2.0
    assert balance.ready_nowait()
    assert silent.polls == 2  # re-checked once, parked again
    clock.now = 3.0
    assert balance.ready_nowait()
    assert silent.polls == 2
    silent.ready = True
    clock.now = 4.0
    assert balance.ready_nowait()
    assert silent.polls == 3
    assert balance.endpoint("s").state is ReadinessState.READY


def test_a_wake_during_poll_ready_is_not_lost() -> None:
    class WakesAtOnce(Counting):
        def poll_ready(self, wake: Callable[[], None]) -> bool:
            self.polls += 1
            wake()  # readiness may already have changed
            return self.polls > 1

    svc = WakesAtOnce()
    balance: Balance[object, object] = Balance(First(), [Endpoint("a", svc)], clock=Clock())
    assert balance.ready_nowait() is False
    assert balance.statistics().pending == 0  # not parked: polled again next scan
    assert balance.ready_nowait() is True


def test_a_stale_wake_of_a_removed_endpoint_does_nothing() -> None:
    svc = Counting(ready=False)
    balance: Balance[object, object] = Balance(First(), [Endpoint("a", svc)], clock=Clock())
    assert balance.ready_nowait() is False
    removed = balance.remove("a")
    assert svc.wake is not None
    before = balance.wake_count
    svc.wake()  # the old wake of an endpoint that left
    assert balance.statistics().pending == 0 and removed.index is None
    assert balance.wake_count == before + 1  # it only wakes waiters
    # Re-added elsewhere, the old wake does not touch the new owner's lists.
    other: Balance[object, object] = Balance(First(), [removed], clock=Clock())
    assert other.ready_nowait() is False
    svc.ready = True
    svc.wake()  # the new wake now (poll_ready stored it)
    assert other.ready_nowait() is True


def test_replace_and_splice_keep_parked_endpoints_parked() -> None:
    a, b = Counting(ready=False), Counting()
    ea, eb = Endpoint("a", a), Endpoint("b", b)
    balance: Balance[object, object] = Balance(First(), [ea, eb], clock=Clock())
    assert balance.ready_nowait()
    balance.replace_endpoints([eb, ea])
    balance.splice(appended=[Endpoint("c", Counting())])
    assert balance.ready_nowait()
    assert a.polls == 1 and balance.statistics().pending == 1
    balance.remove("a")
    assert balance.statistics().pending == 0


def test_bad_pending_recheck_is_rejected() -> None:
    for value in (0, -1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(InvalidInput, match="pending_recheck"):
            Balance(First(), [], pending_recheck=value)  # type: ignore[arg-type]


async def test_busy_concurrency_limits_are_parked_and_return_on_their_wake() -> None:
    gate = anyio.Event()

    async def slow(request: object) -> object:
        await gate.wait()
        return request

    limits = [ConcurrencyLimit(service_fn(slow), 1) for _ in range(4)]
    eps = [Endpoint(i, s, tracker=PeakEwma()) for i, s in enumerate(limits)]
    balance: Balance[object, object] = Balance(PowerOfTwoChoices(random.Random(1)), eps)
    async with anyio.create_task_group() as tg:
        for n in range(4):
            tg.start_soon(balance.dispatch, n)
        await anyio.wait_all_tasks_blocked()
        assert all(s.in_use == 1 for s in limits)
        # A fifth dispatch finds everything busy: each is polled once, parked.
        tg.start_soon(balance.dispatch, 4)
        await anyio.wait_all_tasks_blocked()
        assert balance.statistics().pending == 4
        gate.set()
    assert balance.statistics().in_flight == 0
    assert sum(s.in_use + s.reserved for s in limits) <= 4


def test_scan_cost_is_flat_in_the_number_of_busy_endpoints() -> None:
    """Polls per dispatch stay O(1) with half of 2,000 endpoints busy."""
    clock = Clock()
    services = [Counting(ready=i % 2 == 0) for i in range(2000)]
    eps = [Endpoint(i, s) for i, s in enumerate(services)]
    balance: Balance[object, object] = Balance(First(), eps, clock=clock)
    assert balance.ready_nowait()
    first = sum(s.polls for s in services)
    assert first == 2000
    for _ in range(500):
        clock.now += 0.001  # 0.5 s in all: shorter than pending_recheck
        assert balance.ready_nowait()
        coro = balance.call("x")  # the service never suspends: runs to the end
        with pytest.raises(StopIteration):
            coro.send(None)
    # Each scan re-polls the endpoint the previous call consumed, nothing else.
    assert sum(s.polls for s in services) - first == 499


def test_endpoint_support_helpers_still_park_through_mode_changes() -> None:
    (ep,) = endpoints("a", mode="pending")
    balance: Balance[object, object] = Balance(First(), [ep], clock=Clock())
    assert balance.ready_nowait() is False
    ctl(ep).mode = "ready"  # fires the remembered wake, as a real service would
    assert balance.ready_nowait() is True


def test_due_rechecks_are_spread_over_scans_while_something_is_ready() -> None:
    clock = Clock()
    ready = Counting()
    silent = [Counting(ready=False) for _ in range(1000)]
    balance: Balance[object, object] = Balance(
        First(),
        [Endpoint("r", ready), *(Endpoint(i, svc) for i, svc in enumerate(silent))],
        clock=clock,
    )
    assert balance.ready_nowait()
    assert all(svc.polls == 1 for svc in silent)  # the first scan parked them all
    clock.now = 1.0  # every one is due at once
    scans = 0
    while sum(svc.polls for svc in silent) < 2000:
        before = sum(svc.polls for svc in silent)
        assert balance.ready_nowait()
        scans += 1
        assert sum(svc.polls for svc in silent) - before <= 64  # no latency spike
    assert scans == 16  # 1000 / 64, rounded up: each one re-polled once
    assert all(svc.polls == 2 for svc in silent)
    assert balance.statistics().pending == 1000


def test_with_nothing_ready_every_due_recheck_runs_in_one_scan() -> None:
    clock = Clock()
    silent = [Counting(ready=False) for _ in range(200)]
    balance: Balance[object, object] = Balance(
        First(), [Endpoint(i, svc) for i, svc in enumerate(silent)], clock=clock
    )
    assert balance.ready_nowait() is False
    clock.now = 1.0
    silent[-1].ready = True
    assert balance.ready_nowait()  # found in this scan, not after 4 more
    assert all(svc.polls == 2 for svc in silent)
