"""A state machine over the balance: membership, readiness and calls interleaved.

Calls are driven by stepping their coroutines by hand (``call()`` adds no
checkpoint and the services suspend on a bare yield), so the whole machine is
synchronous and deterministic. After every step the balance's internal lists,
the services' reservations and the trackers' loads must agree.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from poise import (
    Balance,
    Endpoint,
    EndpointError,
    InFlight,
    InvalidInput,
    ReadinessError,
    ReadinessState,
    RoundRobin,
    SelectionError,
)
from tests.poise._balance_support import assert_flat_mirrors

KEYS = ["a", "b", "c", "d", "e"]
MODES = ["ready", "pending", "fail"]


class FakeCancel(BaseException):
    """Stands in for trio.Cancelled / asyncio.CancelledError."""


@types.coroutine
def _suspend() -> Generator[str, None, None]:
    yield "suspended"


class ModelService:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.reserved = 0
        self.violations: list[str] = []
        self.wakes: list[Callable[[], None]] = []

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        if self.reserved:
            self.violations.append("polled while holding a reservation")
        if self.mode == "fail":
            raise OSError("down")
        if self.mode == "pending":
            self.wakes.append(wake)
            return False
        self.reserved += 1
        return True

    def release_reservation(self) -> None:
        if self.reserved != 1:
            self.violations.append("released without a reservation")
        self.reserved = 0

    async def call(self, request: object) -> object:
        if self.reserved != 1:
            self.violations.append("called without a reservation")
        self.reserved = 0
        await _suspend()
        return request


def _tracker(ep: Endpoint[object, object]) -> InFlight:
    tracker = ep.tracker
    assert isinstance(tracker, InFlight)
    return tracker


class BalanceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.balance: Balance[object, object] = Balance(RoundRobin(), clock=lambda: 0.0)
        self.all: list[Endpoint[object, object]] = []  # every endpoint ever made
        self.calls: list[tuple[Endpoint[object, object], Coroutine[Any, Any, object]]] = []
        self.replaced: list[ModelService] = []  # services swapped out of an endpoint

    def _new(self, key: str, mode: str) -> Endpoint[object, object]:
        ep: Endpoint[object, object] = Endpoint(key, ModelService(mode))
        self.all.append(ep)
        return ep

    def _members(self) -> dict[object, Endpoint[object, object]]:
        return {ep.key: ep for ep in self.balance.endpoints}

    @rule(key=st.sampled_from(KEYS), mode=st.sampled_from(MODES))
    def push(self, key: str, mode: str) -> None:
        ep = self._new(key, mode)
        if key in self._members():
            try:
                self.balance.push(ep)
            except InvalidInput:
                return
            raise AssertionError("duplicate key accepted")
        self.balance.push(ep)
        assert ep.state is ReadinessState.IDLE

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: str) -> None:
        if key in self._members():
            ep = self.balance.remove(key)
            assert ep.index is None

    @rule(data=st.data())
    def replace(self, data: st.DataObject) -> None:
        current = list(self.balance.endpoints)
        kept = data.draw(
            st.lists(st.sampled_from(current), unique=True) if current else st.just([])
        )
        taken = {ep.key for ep in kept}
        fresh_keys = data.draw(st.lists(st.sampled_from(KEYS), unique=True, max_size=2))
        fresh = [self._new(k, data.draw(st.sampled_from(MODES))) for k in fresh_keys]
        new = kept + fresh
        before = {id(ep): (ep.state, ep.error) for ep in kept}
        if any(k in taken for k in fresh_keys):
            try:
                self.balance.replace_endpoints(new)
            except InvalidInput:
                assert list(self.balance.endpoints) == current
                return
            raise AssertionError("duplicate key accepted")
        order = data.draw(st.permutations(new))
        self.balance.replace_endpoints(order)
        for ep in kept:
            assert (ep.state, ep.error) == before[id(ep)]
        for ep in fresh:
            assert ep.state is ReadinessState.IDLE

    @rule(key=st.sampled_from(KEYS), mode=st.sampled_from(MODES))
    def set_mode(self, key: str, mode: str) -> None:
        ep = self._members().get(key)
        if ep is None:
            return
        svc = ep.service
        assert isinstance(svc, ModelService)
        svc.mode = mode
        if mode == "ready":
            wakes, svc.wakes = svc.wakes, []
            for wake in wakes:
                wake()

    @rule(key=st.sampled_from(KEYS), mode=st.sampled_from(MODES))
    def swap_service(self, key: str, mode: str) -> None:
        ep = self._members().get(key)
        if ep is None:
            return
        old = ep.service
        assert isinstance(old, ModelService)
        state = ep.state
        ep.service = ModelService(mode)
        self.replaced.append(old)
        assert old.reserved == 0
        if state is ReadinessState.FAILED:
            assert ep.state is ReadinessState.FAILED
        else:
            assert ep.state is ReadinessState.IDLE

    @rule(key=st.sampled_from(KEYS), eligible=st.booleans())
    def set_eligible(self, key: str, eligible: bool) -> None:
        ep = self._members().get(key)
        if ep is not None:
            ep.eligible = eligible

    @rule(key=st.sampled_from(KEYS))
    def endpoint_mut(self, key: str) -> None:
        if key in self._members():
            ep = self.balance.endpoint_mut(key)
            assert ep.state is not ReadinessState.READY

    @rule(key=st.sampled_from(KEYS))
    def reset(self, key: str) -> None:
        if key in self._members():
            self.balance.reset(key)

    @rule()
    def reset_all(self) -> None:
        self.balance.reset_all()

    @rule()
    def scan(self) -> None:
        members = list(self.balance.endpoints)
        try:
            ready = self.balance.ready_nowait()
        except (SelectionError, ReadinessError):
            assert not any(ep.eligible and ep.state is not ReadinessState.FAILED for ep in members)
            return
        assert ready == any(ep.state is ReadinessState.READY for ep in members)
        if not ready:
            assert any(ep.eligible and ep.state is ReadinessState.IDLE for ep in members)

    @rule(request=st.integers())
    def start_call(self, request: int) -> None:
        had_ready = self.balance.statistics().ready > 0
        coro = self.balance.call(request)
        try:
            coro.send(None)
        except SelectionError:
            assert not had_ready
            return
        assert had_ready
        picked = [ep for ep in self.all if _tracker(ep).in_flight > self._open_on(ep)]
        assert len(picked) == 1
        assert picked[0].state is ReadinessState.IDLE
        self.calls.append((picked[0], coro))

    def _open_on(self, ep: Endpoint[object, object]) -> int:
        return sum(1 for e, _ in self.calls if e is ep)

    @precondition(lambda self: bool(self.calls))
    @rule(data=st.data(), how=st.sampled_from(["ok", "fail", "cancel"]))
    def end_call(self, data: st.DataObject, how: str) -> None:
        ep, coro = self.calls.pop(data.draw(st.integers(0, len(self.calls) - 1)))
        if how == "ok":
            try:
                coro.send(None)
            except StopIteration:
                pass
            else:
                raise AssertionError("call did not finish")
        elif how == "fail":
            try:
                coro.throw(ValueError("boom"))
            except EndpointError as exc:
                assert exc.key == ep.key
                assert isinstance(exc.__cause__, ValueError)
            else:
                raise AssertionError("error not raised")
        else:
            try:
                coro.throw(FakeCancel())
            except FakeCancel:
                pass
            else:
                raise AssertionError("cancellation swallowed")

    @invariant()
    def consistent(self) -> None:
        b = self.balance
        members = list(b.endpoints)
        assert [ep.index for ep in members] == list(range(len(members)))
        listed = [ep for ep in b._ready if ep.state is ReadinessState.READY]
        assert listed == [ep for ep in members if ep.state is ReadinessState.READY]
        for ep in b._ready:
            assert ep._listed and ep._owner is b
            if ep.state is not ReadinessState.READY:
                # Consumed by a call and not scanned since: IDLE, awaiting a flush.
                assert ep.state is ReadinessState.IDLE and ep in b._consumed
        assert all(ep._listed == (ep in b._ready) for ep in self.all)
        # The scan walks exactly the IDLE endpoints that can be picked and
        # are not parked waiting for their wake; the parked ones are counted.
        assert {id(ep) for ep in b._idle} == {
            id(ep)
            for ep in members
            if ep.state is ReadinessState.IDLE and ep.eligible and not ep.ejected and ep._parked < 0
        }
        assert b._parked_count == sum(ep._parked >= 0 for ep in members)
        assert all(ep._parked < 0 for ep in self.all if ep not in members)
        assert len(b._idle) == len({id(ep) for ep in b._idle})
        assert all(b._idle[ep._slot] is ep for ep in b._idle)
        member_ids = {id(ep) for ep in members}
        for ep in self.all:
            svc = ep.service
            assert isinstance(svc, ModelService)
            assert svc.violations == []
            if id(ep) in member_ids:
                assert svc.reserved == (1 if ep.state is ReadinessState.READY else 0)
                if ep.state is ReadinessState.READY:
                    assert ep.eligible
            else:
                assert svc.reserved == 0 and ep.index is None
            assert _tracker(ep).in_flight == self._open_on(ep)
        for svc in self.replaced:
            assert svc.reserved == 0 and svc.violations == []
        assert_flat_mirrors(b)
        stats = b.statistics()
        assert stats.in_flight == len(self.calls)
        assert stats.idle + stats.ready + stats.failed == stats.endpoints == len(members)

    def teardown(self) -> None:
        for _, coro in self.calls:
            coro.close()


BalanceMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_balance_state_machine = BalanceMachine.TestCase
