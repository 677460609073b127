"""The scan that finds many endpoints READY at once lists them in one merge.

A balance's first dispatch scans every endpoint; the scan visits the idle
list out of index order (it swap-removes the endpoints it takes), so listing
each READY endpoint in the ordered ready list as it was found cost a
bisection and the shift of the list's tail per endpoint: O(n^2) item moves
for n endpoints (about 39 ms at 10,000, inside the first dispatch). The
scan now lists them when it ends, with one sort of two ordered runs.
These tests count the index reads of that listing (never a wall clock) and
check the ready list, its rows and the drains that happen during a scan.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import poise._balance
from poise import Balance, Endpoint, PeakEwma, PowerOfTwoChoices, ReadinessState

from ._balance_support import First


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Ready:
    """Always ready; ``on_poll`` runs inside its poll_ready (a re-entrant edit)."""

    def __init__(self) -> None:
        self.on_poll: Callable[[], None] | None = None

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        on_poll, self.on_poll = self.on_poll, None
        if on_poll is not None:
            on_poll()
        return True

    async def call(self, request: object) -> object:
        return request


def _check_lists(balance: Balance[object, object]) -> None:
    """_ready holds exactly the listed endpoints in index order, _rrows their rows."""
    ready = balance._ready
    assert [ep.index for ep in ready] == sorted(ep.index for ep in ready)  # type: ignore[type-var]
    assert balance._rrows == [ep._row for ep in ready]
    listed = [ep for ep in balance.endpoints if ep._listed]
    assert ready == listed
    assert all(ep.state is ReadinessState.READY for ep in ready)


def test_a_first_scan_of_many_endpoints_reads_each_index_about_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 2000
    eps = [Endpoint(i, Ready(), tracker=PeakEwma()) for i in range(n)]
    balance: Balance[object, object] = Balance(First(), eps, clock=Clock())
    reads = 0
    by_index = poise._balance._by_index

    def counted(ep: Endpoint[object, object]) -> int:
        nonlocal reads
        reads += 1
        index: int = by_index(ep)
        return index

    monkeypatch.setattr(poise._balance, "_by_index", counted)
    assert balance.ready_nowait()
    # One key per endpoint for the merge; one bisection per endpoint would
    # read about log2(n) = 11 indices each.
    assert reads <= 2 * n
    assert balance._ready == eps
    _check_lists(balance)


def test_a_few_endpoints_found_ready_later_are_inserted_in_order() -> None:
    services = [Ready() for _ in range(40)]
    eps = [Endpoint(i, s, eligible=i % 10 != 3) for i, s in enumerate(services)]
    balance: Balance[object, object] = Balance(First(), eps, clock=Clock())
    assert balance.ready_nowait()
    _check_lists(balance)
    for ep in eps[3::10]:
        ep.eligible = True
    assert balance.ready_nowait()
    assert balance._ready == eps
    _check_lists(balance)


def test_an_endpoint_drained_during_the_scan_that_found_it_ready_is_not_listed() -> None:
    services = [Ready() for _ in range(40)]
    eps = [Endpoint(i, s, tracker=PeakEwma()) for i, s in enumerate(services)]
    balance: Balance[object, object] = Balance(First(), eps, clock=Clock())
    victim = eps[0]  # scanned first (the idle list starts in index order)

    def drain() -> None:
        assert victim.state is ReadinessState.READY  # found READY by this same scan
        victim.eligible = False

    services[20].on_poll = drain
    assert balance.ready_nowait()
    assert victim not in balance._ready and not victim._listed
    assert victim.state is ReadinessState.IDLE
    assert balance._ready == eps[1:]
    _check_lists(balance)


def test_a_scan_from_inside_a_poll_ready_lists_what_the_outer_scan_found() -> None:
    services = [Ready() for _ in range(40)]
    eps = [Endpoint(i, s, tracker=PeakEwma()) for i, s in enumerate(services)]
    balance: Balance[object, object] = Balance(First(), eps, clock=Clock())
    victim = eps[0]  # scanned first, by the outer scan
    inner: list[bool] = []

    def scan_again() -> None:
        inner.append(balance.ready_nowait())
        _check_lists(balance)

    def drain() -> None:
        victim.eligible = False

    services[30].on_poll = scan_again  # the scan order is 0, 39, 38, ...
    services[20].on_poll = drain  # in the inner scan or after it
    assert balance.ready_nowait()
    assert inner == [True]
    assert victim not in balance._ready and victim.state is ReadinessState.IDLE
    assert balance._ready == eps[1:]
    _check_lists(balance)


async def test_dispatch_never_picks_an_endpoint_drained_during_its_first_scan() -> None:
    services = [Ready() for _ in range(40)]
    eps = [Endpoint(i, s, tracker=PeakEwma()) for i, s in enumerate(services)]
    balance: Balance[object, object] = Balance(PowerOfTwoChoices(random.Random(1)), eps)
    victim = eps[0]

    def drain() -> None:
        victim.eligible = False

    services[20].on_poll = drain
    # The first dispatch runs the scan in which the victim is drained.
    for i in range(300):
        assert await balance.dispatch(i) == i
    assert victim.tracker.observations == 0  # type: ignore[attr-defined]
    assert sum(ep.tracker.observations for ep in eps) == 300  # type: ignore[attr-defined]
    assert balance.ready_nowait()  # the last one called is listed, IDLE, until a scan
    _check_lists(balance)


def _setting(todo: list[tuple[Endpoint[object, object], bool]]) -> Callable[[], None]:
    """What one poll_ready does: set these endpoints' eligibility, in order."""

    def run() -> None:
        for ep, eligible in todo:
            ep.eligible = eligible

    return run


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=60),
    edits=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 59), st.booleans()), max_size=12),
    pending=st.sets(st.integers(0, 59), max_size=10),
)
def test_drains_and_returns_during_a_scan_keep_the_ready_list_ordered(
    n: int, edits: list[tuple[int, int, bool]], pending: set[int]
) -> None:
    """Any drain or return of an endpoint, from inside another's poll_ready."""
    # One more endpoint that no edit touches keeps the balance usable.
    services = [Ready() for _ in range(n + 1)]
    eps = [Endpoint(i, s, eligible=i not in pending) for i, s in enumerate(services)]
    balance: Balance[object, object] = Balance(First(), eps, clock=Clock())
    actions: dict[int, list[tuple[Endpoint[object, object], bool]]] = {}
    for at, target, eligible in edits:
        if at < n and target < n:
            actions.setdefault(at, []).append((eps[target], eligible))
    for at, todo in actions.items():
        services[at].on_poll = _setting(todo)
    assert balance.ready_nowait()
    _check_lists(balance)
    # Whatever the edits, another scan settles every eligible endpoint READY.
    assert balance.ready_nowait()
    _check_lists(balance)
    assert balance._ready == [ep for ep in eps if ep.eligible]
