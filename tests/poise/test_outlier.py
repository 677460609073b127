"""OutlierDetector: the decision core (exhaustively) and its use by Balance."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import anyio
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from poise import (
    Balance,
    Endpoint,
    EndpointError,
    InvalidInput,
    OutlierDetector,
    OutlierEvent,
    PeakEwma,
    ReadinessState,
)

from ._balance_support import First

# -- the decision core ----------------------------------------------------------------


def detector(**kwargs: object) -> tuple[OutlierDetector, list[OutlierEvent]]:
    seen: list[OutlierEvent] = []
    options: dict[str, object] = {"max_ejection_percent": 50.0, "observer": seen.append}
    options.update(kwargs)
    return OutlierDetector(**options), seen  # type: ignore[arg-type]


def test_consecutive_failures_eject_for_the_base_time() -> None:
    d, seen = detector(consecutive_failures=3, base_ejection_time=30.0)
    d.sync(["a", "b"], 0.0)
    assert d.record("a", True, 1.0) is None
    assert d.record("a", True, 2.0) is None
    event = d.record("a", True, 3.0)
    assert event == OutlierEvent("a", True, 3.0, 33.0, 1, "consecutive failures")
    assert seen == [event]
    assert d.is_ejected("a") and d.ejected == ("a",) and d.ejected_until("a") == 33.0
    assert d.next_due() == 33.0
    assert d.expire(32.9) == []
    back = d.expire(33.0)
    assert back == [OutlierEvent("a", False, 33.0, 33.0, 1, "expired")]
    assert seen[-1] == back[0] and not d.is_ejected("a") and d.next_due() == math.inf


def test_a_success_resets_the_consecutive_count() -> None:
    d, _ = detector(consecutive_failures=2)
    d.sync(["a", "b"], 0.0)
    d.record("a", True, 1.0)
    d.record("a", False, 2.0)
    assert d.record("a", True, 3.0) is None
    assert d.record("a", True, 4.0) is not None


def test_repeated_ejections_grow_the_time_up_to_the_maximum() -> None:
    d, _ = detector(consecutive_failures=1, base_ejection_time=10.0, max_ejection_time=25.0)
    d.sync(["a", "b"], 0.0)
    durations = []
    now = 0.0
    for _ in range(4):
        event = d.record("a", True, now)
        assert event is not None
        durations.append(event.until - event.at)
        now = event.until
        d.expire(now)
    assert durations == [10.0, 20.0, 25.0, 25.0]
    # After staying in for max_ejection_time the multiplier starts again.
    event = d.record("a", True, now + 25.0)
    assert event is not None and event.ejections == 1 and event.until - event.at == 10.0


def test_failure_rate_over_a_window() -> None:
    d, _ = detector(consecutive_failures=None, failure_rate=0.5, window=10.0, minimum_calls=4)
    d.sync(["a", "b"], 0.0)
    # 3 failures of 4 in one window, never 2 in a row... until the 4th outcome.
    assert d.record("a", True, 0.0) is None
    assert d.record("a", False, 1.0) is None
    assert d.record("a", True, 2.0) is None
    event = d.record("a", True, 3.0)
    assert event is not None and event.reason == "failure rate"
    # Outcomes spread over several windows do not add up.
    d2, _ = detector(consecutive_failures=None, failure_rate=0.5, window=10.0, minimum_calls=4)
    d2.sync(["a", "b"], 0.0)
    for n in range(12):
        assert d2.record("a", n % 4 == 0, n * 4.0) is None


def test_never_more_than_max_ejection_percent() -> None:
    d, _ = detector(consecutive_failures=1, max_ejection_percent=20.0)
    d.sync([f"k{i}" for i in range(10)], 0.0)
    assert d.capacity == 2
    ejected = [d.record(f"k{i}", True, 1.0) for i in range(5)]
    assert [e is not None for e in ejected] == [True, True, False, False, False]
    assert len(d.ejected) == 2
    # Members leave: the cap shrinks and the newest ejection returns early.
    events = d.sync([f"k{i}" for i in range(6)], 2.0)
    assert [(e.key, e.ejected, e.reason) for e in events] == [("k1", False, "cap")]
    assert list(d.ejected) == ["k0"]


def test_removal_of_an_ejected_member_is_a_return() -> None:
    d, seen = detector(consecutive_failures=1)
    d.sync(["a", "b"], 0.0)
    d.record("a", True, 0.0)
    events = d.remove("a", 1.0)
    assert [(e.key, e.ejected, e.reason) for e in events] == [("a", False, "removed")]
    assert d.members == 1 and d.ejected == () and seen[-1] == events[0]
    assert d.record("a", True, 2.0) is None  # unknown keys are ignored


def test_release_all_ends_every_ejection() -> None:
    d, _ = detector(consecutive_failures=1, max_ejection_percent=100.0)
    d.sync(["a", "b"], 0.0)
    d.record("a", True, 0.0)
    d.record("b", True, 0.0)
    events = d.release_all(1.0)
    assert {e.key for e in events} == {"a", "b"} and d.ejected == ()
    assert d.expire(1000.0) == []  # the old heap entries are stale


def one_failure_ejects() -> tuple[OutlierDetector, list[OutlierEvent]]:
    """One failure ejects, for 10 s x k (up to 100 s), any share of the pool."""
    return detector(
        consecutive_failures=1,
        max_ejection_percent=100.0,
        base_ejection_time=10.0,
        max_ejection_time=100.0,
    )


def test_a_reinstated_ejection_ends_at_the_next_expire_and_starts_over() -> None:
    d, seen = one_failure_ejects()
    d.sync(["a", "b", "c"], 0.0)
    d.record("a", True, 0.0)
    d.expire(10.0)
    d.record("a", True, 10.0)  # its second ejection in a row: 2 x the base
    d.record("b", True, 10.0)
    assert d.ejected_until("a") == 30.0 and d.ejected_until("b") == 20.0
    assert not d.reinstate("c", 11.0)  # not ejected: nothing to end
    assert d.reinstate("a", 11.0, "back")
    assert d.reinstate("a", 12.0, "back")  # marked again: the earlier time stays
    assert d.next_due() == 11.0 and d.ejected_until("a") == 11.0
    assert d.expire(10.5) == []
    events = d.expire(11.5)
    assert [(e.key, e.ejected, e.reason, e.ejections) for e in events] == [("a", False, "back", 2)]
    assert seen[-1] == events[0]
    # A new member again: its next ejection lasts the base time; "b" keeps its own.
    assert d.ejections("a") == 0 and d.ejected_until("b") == 20.0
    again = d.record("a", True, 12.0)
    assert again is not None and again.until == 22.0 and again.ejections == 1
    assert [e.reason for e in d.expire(20.0)] == ["expired"]


def test_a_reinstated_key_that_returned_otherwise_keeps_its_count() -> None:
    d, _ = one_failure_ejects()
    d.sync(["a", "b"], 0.0)
    d.record("a", True, 0.0)
    assert d.reinstate("a", 5.0)
    released = d.release_all(1.0)  # returned before the mark was due
    assert [(e.key, e.reason) for e in released] == [("a", "exhausted")]
    assert d.ejections("a") == 1
    assert d.expire(5.0) == []  # the mark went with the ejection
    d.record("a", True, 6.0)
    assert d.ejected_until("a") == 6.0 + 20.0  # its second ejection in a row
    assert [e.reason for e in d.expire(26.0)] == ["expired"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"consecutive_failures": 0}, "consecutive_failures"),
        ({"consecutive_failures": True}, "consecutive_failures"),
        ({"consecutive_failures": None}, "both are off"),
        ({"failure_rate": 1.5}, "failure_rate"),
        ({"failure_rate": 0.0}, "failure_rate"),
        ({"failure_rate": math.nan}, "failure_rate"),
        ({"window": 0}, "window"),
        ({"minimum_calls": 0}, "minimum_calls"),
        ({"base_ejection_time": -1.0}, "base_ejection_time"),
        ({"base_ejection_time": math.inf}, "base_ejection_time"),
        ({"max_ejection_time": 1.0}, "max_ejection_time"),
        ({"max_ejection_percent": 101}, "max_ejection_percent"),
        ({"max_ejection_percent": -1}, "max_ejection_percent"),
        ({"observer": 3}, "observer"),
    ],
)
def test_bad_parameters_are_rejected(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        OutlierDetector(**kwargs)  # type: ignore[arg-type]


def test_a_non_finite_time_is_rejected() -> None:
    d, _ = detector()
    d.add("a")
    with pytest.raises(InvalidInput, match="finite"):
        d.record("a", True, math.nan)
    with pytest.raises(InvalidInput, match="finite"):
        d.expire(math.inf)


class DetectorMachine(RuleBasedStateMachine):
    """Any mix of outcomes, time and membership edits keeps the rules."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[OutlierEvent] = []
        self.d = OutlierDetector(
            consecutive_failures=2,
            failure_rate=0.6,
            window=5.0,
            minimum_calls=3,
            base_ejection_time=3.0,
            max_ejection_time=7.0,
            max_ejection_percent=40.0,
            observer=self.events.append,
        )
        self.now = 0.0
        self.members: set[str] = set()
        #: Keys reinstate() marked, until they return.
        self.marked: set[str] = set()
        self.sync([f"k{i}" for i in range(5)])

    def sync(self, keys: list[str]) -> None:
        self.d.sync(keys, self.now)
        self.members = set(keys)

    @rule(key=st.sampled_from([f"k{i}" for i in range(8)]), failed=st.booleans())
    def outcome(self, key: str, failed: bool) -> None:
        before = self.d.is_ejected(key)
        event = self.d.record(key, failed, self.now)
        if event is not None:
            assert failed and not before and event.ejected and event.key == key
            assert self.now + 3.0 <= event.until <= self.now + 7.0

    @rule(step=st.floats(min_value=0.0, max_value=4.0))
    def advance(self, step: float) -> None:
        self.now += step
        marked = set(self.marked)
        for event in self.d.expire(self.now):
            assert not event.ejected and event.at == self.now
            key = str(event.key)
            assert (event.reason == "early") == (key in marked)
            if key in marked:
                assert self.d.ejections(key) == 0
        # Every marked key returned at this expire.
        assert not marked & set(self.d.ejected)

    @rule(key=st.sampled_from([f"k{i}" for i in range(8)]))
    def reinstate(self, key: str) -> None:
        ejected = self.d.is_ejected(key)
        assert self.d.reinstate(key, self.now, "early") == ejected
        if ejected:
            self.marked.add(key)
            assert self.d.next_due() <= self.now

    @rule(keys=st.sets(st.sampled_from([f"k{i}" for i in range(8)])))
    def membership(self, keys: set[str]) -> None:
        self.sync(sorted(keys))

    @precondition(lambda self: bool(self.d.ejected))
    @rule()
    def wait_out_every_ejection(self) -> None:
        self.now += 7.0
        self.d.expire(self.now)
        assert self.d.ejected == ()

    @invariant()
    def within_the_cap(self) -> None:
        assert len(self.d.ejected) <= int(len(self.members) * 0.4 + 1e-9)
        assert set(self.d.ejected) <= self.members
        assert self.d.members == len(self.members)

    @invariant()
    def every_ejection_ends_in_time(self) -> None:
        for key in self.d.ejected:
            until = self.d.ejected_until(key)
            assert until is not None and until <= self.now + 7.0
            assert until >= self.now if key in self.marked else until > self.now
        if self.d.ejected:
            assert self.d.next_due() <= self.now + 7.0

    @invariant()
    def events_alternate_per_key(self) -> None:
        state: dict[object, bool] = {}
        for event in self.events:
            assert state.get(event.key, False) != event.ejected
            state[event.key] = event.ejected
        assert {k for k, v in state.items() if v} == set(self.d.ejected)
        # A mark lasts while its ejection does (it returned: for whatever reason).
        self.marked &= set(self.d.ejected)


DetectorMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
test_detector_machine = DetectorMachine.TestCase


# -- through a Balance ---------------------------------------------------------------


class Flaky:
    """Always ready; each call fails while ``failing`` is set."""

    def __init__(self) -> None:
        self.failing = False
        self.calls = 0

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        return True

    async def call(self, request: object) -> object:
        self.calls += 1
        if self.failing:
            raise ConnectionError("down")
        return request


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(coro: object) -> object:
    """Run a coroutine that never suspends (ready_nowait + call on Flaky)."""
    try:
        coro.send(None)  # type: ignore[attr-defined]
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the call suspended")


def test_an_ejected_endpoint_is_not_picked_and_returns_by_itself() -> None:
    clock = Clock()
    seen: list[OutlierEvent] = []
    services = [Flaky(), Flaky(), Flaky()]
    eps = [Endpoint(i, s, tracker=PeakEwma()) for i, s in enumerate(services)]
    d = OutlierDetector(
        consecutive_failures=2,
        base_ejection_time=10.0,
        max_ejection_percent=50.0,
        observer=seen.append,
    )
    balance: Balance[object, object] = Balance(First(), eps, clock=clock, outlier_detector=d)
    assert balance.outlier_detector is d
    services[0].failing = True
    for _ in range(2):
        assert balance.ready_nowait()
        with pytest.raises(EndpointError):
            run(balance.call("x"))
    assert [e.ejected for e in seen] == [True]
    assert eps[0].ejected and eps[0].state is ReadinessState.IDLE
    assert balance.statistics().ejected == 1
    assert "ejected" in repr(eps[0])
    # Ejected: every pick goes elsewhere, First() would otherwise take index 0.
    for _ in range(5):
        clock.now += 1.0
        assert balance.ready_nowait()
        assert run(balance.call("y")) == "y"
    assert services[0].calls == 2
    services[0].failing = False
    clock.now = 10.0 + 0.5
    assert balance.ready_nowait()
    assert run(balance.call("z")) == "z"
    assert services[0].calls == 3  # back by itself, picked first again
    assert [e.ejected for e in seen] == [True, False] and seen[1].reason == "expired"
    assert balance.statistics().in_flight == 0


def test_ejections_never_leave_nothing_to_pick() -> None:
    clock = Clock()
    services = [Flaky(), Flaky()]
    eps = [Endpoint(i, s) for i, s in enumerate(services)]
    d = OutlierDetector(consecutive_failures=1, max_ejection_percent=50.0)
    balance: Balance[object, object] = Balance(First(), eps, clock=clock, outlier_detector=d)
    services[0].failing = True
    assert balance.ready_nowait()
    with pytest.raises(EndpointError):
        run(balance.call("x"))
    assert eps[0].ejected
    balance.remove(1)  # the only endpoint left is ejected
    assert balance.ready_nowait()  # the ejection is lifted ("exhausted")
    assert not eps[0].ejected and d.ejected == ()


async def test_an_ejected_endpoint_keeps_its_in_flight_guard() -> None:
    gate = anyio.Event()
    clock = Clock()

    class Gated(Flaky):
        async def call(self, request: object) -> object:
            self.calls += 1
            if request == "hold":
                await gate.wait()
                return request
            raise ConnectionError("down")

    svc = Gated()
    tracker = PeakEwma()
    eps = [Endpoint("a", svc, tracker=tracker), Endpoint("b", Flaky())]
    d = OutlierDetector(consecutive_failures=1, max_ejection_percent=50.0)
    balance: Balance[object, object] = Balance(First(), eps, clock=clock, outlier_detector=d)
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.dispatch, "hold")
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(EndpointError):
            await balance.dispatch("fail")
        assert eps[0].ejected and tracker.in_flight == 1
        gate.set()
    assert tracker.in_flight == 0 and balance.statistics().in_flight == 0


async def test_held_responses_report_their_outcome() -> None:
    eps = [Endpoint("a", Flaky()), Endpoint("b", Flaky())]
    d = OutlierDetector(consecutive_failures=1, max_ejection_percent=50.0)
    balance: Balance[object, object] = Balance(First(), eps, outlier_detector=d)
    held = await balance.dispatch_held("x")
    assert not eps[0].ejected
    held.complete(failed=True)
    assert eps[0].ejected
    held = await balance.dispatch_held("y")
    assert held.key == "b"
    held.cancel()  # a cancelled response is no evidence
    assert not eps[1].ejected


def test_outlier_detector_must_be_a_detector() -> None:
    with pytest.raises(InvalidInput, match="outlier_detector"):
        Balance(First(), [], outlier_detector=object())  # type: ignore[call-overload]


class BalanceEjectionMachine(RuleBasedStateMachine):
    """Failures, successes, time and membership edits through a real Balance."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.services: dict[str, Flaky] = {}
        self.trackers: dict[str, PeakEwma] = {}
        self.d = OutlierDetector(
            consecutive_failures=2,
            base_ejection_time=2.0,
            max_ejection_time=5.0,
            max_ejection_percent=50.0,
        )
        self.balance: Balance[object, object] = Balance(
            First(), [], clock=self.clock, outlier_detector=self.d
        )
        self.serial = 0
        for _ in range(4):
            self.add()

    def _endpoint(self) -> Endpoint[object, object]:
        self.serial += 1
        key = f"e{self.serial}"
        self.services[key] = Flaky()
        self.trackers[key] = PeakEwma()
        return Endpoint(key, self.services[key], tracker=self.trackers[key])

    @precondition(lambda self: len(self.balance) < 6)
    @rule()
    def add(self) -> None:
        self.balance.push(self._endpoint())

    @precondition(lambda self: len(self.balance) > 1)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        self.balance.remove(data.draw(st.integers(0, len(self.balance) - 1)))

    @precondition(lambda self: len(self.balance) > 0)
    @rule(data=st.data())
    def replace_one(self, data: st.DataObject) -> None:
        at = data.draw(st.integers(0, len(self.balance) - 1))
        self.balance.splice(replaced=[(at, self._endpoint())])

    @rule(data=st.data(), failing=st.booleans())
    def set_failing(self, data: st.DataObject, failing: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.services)))
        self.services[key].failing = failing

    @rule()
    def call(self) -> None:
        try:
            ok = self.balance.ready_nowait()
        except Exception:
            return
        if not ok:
            return
        with contextlib.suppress(EndpointError):
            run(self.balance.call("x"))

    @rule(step=st.floats(min_value=0.0, max_value=3.0))
    def advance(self, step: float) -> None:
        self.clock.now += step

    @invariant()
    def guards_never_leak(self) -> None:
        assert self.balance.statistics().in_flight == 0
        assert all(t.in_flight == 0 for t in self.trackers.values())

    @invariant()
    def within_the_cap_and_consistent(self) -> None:
        members = self.balance.endpoints
        ejected = [ep for ep in members if ep.ejected]
        assert len(ejected) <= len(members) // 2
        assert {ep.key for ep in ejected} == set(self.d.ejected)
        assert all(ep.state is not ReadinessState.READY for ep in ejected)
        assert self.d.members == len(members)

    @invariant()
    def every_ejected_endpoint_returns(self) -> None:
        for ep in self.balance.endpoints:
            if ep.ejected:
                until = self.d.ejected_until(ep.key)
                assert until is not None and until <= self.clock.now + 5.0


BalanceEjectionMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=30, deadline=None
)
test_balance_ejection_machine = BalanceEjectionMachine.TestCase


def test_every_ejection_ends_once_its_time_is_up_at_the_next_scan() -> None:
    clock = Clock()
    services = [Flaky() for _ in range(4)]
    eps = [Endpoint(i, s) for i, s in enumerate(services)]
    d = OutlierDetector(consecutive_failures=1, base_ejection_time=1.0, max_ejection_percent=50.0)
    balance: Balance[object, object] = Balance(First(), eps, clock=clock, outlier_detector=d)
    for s in services:
        s.failing = True
    for _ in range(4):
        assert balance.ready_nowait()
        with pytest.raises(EndpointError):
            run(balance.call("x"))
    assert sum(ep.ejected for ep in eps) == 2  # the cap: 50% of 4
    clock.now = 5.0
    assert balance.ready_nowait()
    assert not any(ep.ejected for ep in eps)
