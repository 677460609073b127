"""A state machine over directory edits, applications and calls in flight.

Random sequences of upserts (equal and unequal values), drains,
finish_drains, removals, readiness scans, dispatches held open, completions
and cancellations, and applications: sync and async, with factories failing
(raising, wrong shape, cancelled) at any position, stale, equal and foreign
snapshots. After every step:

* a failed application left the pool exactly as before (same endpoint
  objects, order, states, eligibility, loads, reservations, revision) and
  closed every service it staged;
* a successful one committed in snapshot order, kept retained endpoints as
  the same objects with the same load and quarantine, and entered the others
  IDLE with eligibility = not draining;
* no service leaks: each one created is live and open, or retired and closed
  exactly once (or still busy with calls in flight); each guard opened ends.

Calls in flight are real ``Balance.call`` coroutines driven by hand, so they
hold their load guards across steps without an event loop; async
applications run in a short ``anyio.run`` on the configured backend.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Generator, Hashable
from typing import Any, cast

import anyio
import anyio.lowlevel
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from poise import (
    Backend,
    Directory,
    DiscoveryBalance,
    Endpoint,
    EndpointError,
    FactoryError,
    ForeignSnapshot,
    InFlight,
    LoadTracker,
    PeakEwma,
    ReadinessError,
    ReadinessState,
    RoundRobin,
    SelectionError,
    Snapshot,
    StaleRevision,
)
from tests.poise._balance_support import assert_flat_mirrors

from ..conftest import BACKEND

KEYS = ("a", "b", "c", "d", "e")
#: The service each hand-driven call reached, in order.
CALLED: list[HeldService] = []


class _Suspend:
    """An awaitable that suspends a hand-driven coroutine once."""

    def __await__(self) -> Generator[None, None, None]:
        yield


class HeldService:
    """A service whose calls stay in flight until the test resumes them."""

    def __init__(self, key: Hashable, number: int) -> None:
        self.key = key
        self.number = number
        self.ready = True
        self.fail = False
        self.reserved = 0
        self.closed = 0
        self.fail_next_call = False

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        if self.fail:
            raise RuntimeError(f"{self.key} broken")
        if self.ready:
            self.reserved += 1
        return self.ready

    def release_reservation(self) -> None:
        self.reserved -= 1

    async def call(self, request: object) -> object:
        self.reserved -= 1
        CALLED.append(self)
        await _Suspend()
        if self.fail_next_call:
            raise RuntimeError("call failed")
        return request

    def close(self) -> None:
        self.closed += 1


class Factory:
    """Builds HeldService generations; can fail, return a wrong shape, or cancel."""

    def __init__(self) -> None:
        self.created: list[HeldService] = []
        self.trackers: list[InFlight | PeakEwma] = []
        self.tracker_of: dict[int, InFlight | PeakEwma] = {}
        self.calls = 0
        self.fail_on: set[int] = set()
        self.wrong_shape_on: set[int] = set()
        self.cancel_on: set[int] = set()
        self.scope: anyio.CancelScope | None = None

    def build(self, key: Hashable) -> object:
        number = self.calls
        self.calls += 1
        if number in self.fail_on:
            raise LookupError(f"factory failure #{number}")
        service = HeldService(key, number)
        self.created.append(service)
        if number in self.wrong_shape_on:
            return (service,)
        # Half the generations are mirrored in the balance's pick table.
        tracker = PeakEwma() if number % 2 else InFlight()
        self.trackers.append(tracker)
        self.tracker_of[id(service)] = tracker
        return service, tracker

    def sync(self, key: Hashable, backend: Backend) -> tuple[HeldService, LoadTracker]:
        return self.build(key)  # type: ignore[return-value]

    async def async_(self, key: Hashable, backend: Backend) -> tuple[HeldService, LoadTracker]:
        await anyio.lowlevel.checkpoint()
        if self.calls in self.cancel_on and self.scope is not None:
            self.calls += 1
            self.scope.cancel()
            await anyio.lowlevel.checkpoint()
        return self.build(key)  # type: ignore[return-value]


def fingerprint(balance: DiscoveryBalance[object, object]) -> list[tuple[object, ...]]:
    return [
        (ep, ep.key, ep.service, ep.state, ep.eligible, ep.load(0.0), ep.service.reserved)  # type: ignore[attr-defined]
        for ep in balance.endpoints
    ] + [("revision", balance.revision, balance.draining)]


class ReconcileMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Directory()
        self.factory = Factory()
        self.sync_balance: DiscoveryBalance[object, object] = DiscoveryBalance(
            RoundRobin(), self.factory.sync, clock=lambda: 0.0
        )
        self.async_balance: DiscoveryBalance[object, object] = DiscoveryBalance(
            RoundRobin(), self.factory.async_, clock=lambda: 0.0
        )
        self.applied: dict[int, dict[Hashable, object]] = {}
        self.history: list[Snapshot] = []
        self.in_flight: list[tuple[Coroutine[Any, Any, object], HeldService]] = []
        CALLED.clear()

    # -- directory edits ----------------------------------------------------------------------

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
        weight=st.sampled_from([1.0, 1.0, 2.0]),
    )
    def upsert(self, keys: list[str], weight: float) -> None:
        # Equal values still make new allocations (rebuilt generations).
        for key in keys:
            self.directory.upsert(key, Backend(f"http://{key}", weight=weight))

    @rule(key=st.sampled_from(KEYS), kind=st.sampled_from(["drain", "finish_drain", "remove"]))
    def membership(self, key: str, kind: str) -> None:
        member = self.directory.snapshot().get(key)
        if member is None:
            return
        if kind == "drain":
            self.directory.drain(key)
        elif kind == "remove":
            self.directory.remove(key)
        elif member.draining:
            self.directory.finish_drain(key)

    # -- applications -------------------------------------------------------------------------

    def _balance(self, use_async: bool) -> DiscoveryBalance[object, object]:
        return self.async_balance if use_async else self.sync_balance

    @rule(
        use_async=st.booleans(),
        fail_at=st.none() | st.integers(0, 4),
        how=st.sampled_from(["raise", "shape", "cancel"]),
    )
    def apply(self, use_async: bool, fail_at: int | None, how: str) -> None:
        balance = self._balance(use_async)
        snapshot = self.directory.snapshot()
        self.history.append(snapshot)
        before = fingerprint(balance)
        created_before = len(self.factory.created)
        calls_before = self.factory.calls
        old_members = dict(self.applied.get(id(balance), {}))
        old_endpoints = {ep.key: ep for ep in balance.endpoints}
        if fail_at is not None:
            target = {calls_before + fail_at}
            if how == "raise" or (how == "cancel" and not use_async):
                self.factory.fail_on = target
            elif how == "shape":
                self.factory.wrong_shape_on = target
            else:
                self.factory.cancel_on = target
        cancelled = False
        try:
            if use_async:

                async def run() -> None:
                    nonlocal cancelled
                    with anyio.CancelScope() as scope:
                        self.factory.scope = scope
                        await balance.apply_snapshot_async(snapshot)
                    cancelled = scope.cancelled_caught

                anyio.run(run, backend=BACKEND)
            else:
                balance.apply_snapshot(snapshot)
        except FactoryError:
            assert fail_at is not None
            failed = True
        else:
            failed = cancelled
        finally:
            self.factory.fail_on = set()
            self.factory.wrong_shape_on = set()
            self.factory.cancel_on = set()
            self.factory.scope = None
        staged = self.factory.created[created_before:]
        if failed:
            assert fingerprint(balance) == before
            assert all(s.closed == 1 for s in staged), staged
            return
        # Committed in snapshot order.
        assert [ep.key for ep in balance.endpoints] == list(snapshot.keys())
        assert balance.revision == snapshot.revision
        assert balance.draining == snapshot.draining
        fresh = {id(s) for s in staged}
        for ep in balance.endpoints:
            member = snapshot.get(ep.key)
            assert member is not None
            assert ep.eligible is not member.draining
            old_allocation = old_members.get(ep.key)
            if old_allocation is member.allocation:
                # Retained: same object, same load, same quarantine.
                prior = old_endpoints[ep.key]
                assert ep is prior
                assert id(ep.service) not in fresh
            else:
                assert id(ep.service) in fresh
                assert ep.state is ReadinessState.IDLE
                assert self.factory.tracker_of[id(ep.service)].in_flight == 0
        live_now = set(map(id, balance.endpoints))
        for prior_ep, _key, _service, state, eligible, load, _reserved in before[:-1]:
            if id(prior_ep) not in live_now:
                continue
            endpoint = cast("Endpoint[object, object]", prior_ep)
            assert endpoint.load(0.0) == load
            if endpoint.eligible == eligible:
                assert endpoint.state is state  # reservation and quarantine kept
            elif state is ReadinessState.READY:
                # Newly draining: the reservation is given back at once.
                assert endpoint.state is ReadinessState.IDLE
            else:
                assert endpoint.state is state
        self.applied[id(balance)] = {m.key: m.allocation for m in snapshot}

    @rule(use_async=st.booleans(), kind=st.sampled_from(["stale", "equal", "foreign"]))
    def apply_invalid(self, use_async: bool, kind: str) -> None:
        balance = self._balance(use_async)
        if balance.revision < 0:
            return
        before = fingerprint(balance)
        calls = self.factory.calls
        if kind == "equal":
            snapshot = next(s for s in reversed(self.history) if s.revision == balance.revision)
            assert not balance.apply_snapshot(snapshot).applied
        elif kind == "stale":
            older = [s for s in self.history if s.revision < balance.revision]
            if not older:
                return
            try:
                balance.apply_snapshot(older[0])
            except StaleRevision:
                pass
            else:
                raise AssertionError("an older revision was applied")
        else:
            other = Directory()
            other.upsert("a", Backend("x"))
            try:
                balance.apply_snapshot(other.snapshot())
            except ForeignSnapshot:
                pass
            else:
                raise AssertionError("a foreign snapshot was applied")
        assert fingerprint(balance) == before and self.factory.calls == calls

    # -- readiness and calls ----------------------------------------------------------------------

    @rule(use_async=st.booleans(), data=st.data())
    def tweak_service(self, use_async: bool, data: st.DataObject) -> None:
        endpoints = self._balance(use_async).endpoints
        if not endpoints:
            return
        service = data.draw(st.sampled_from(endpoints)).service
        assert isinstance(service, HeldService)
        service.ready = data.draw(st.booleans())
        service.fail = data.draw(st.sampled_from([False, False, True]))

    @rule(use_async=st.booleans())
    def reset(self, use_async: bool) -> None:
        self._balance(use_async).balance.reset_all()

    @rule(use_async=st.booleans())
    def dispatch(self, use_async: bool) -> None:
        balance = self._balance(use_async).balance
        try:
            if not balance.ready_nowait():
                return
        except (SelectionError, ReadinessError):
            return
        coroutine = balance.call("request")
        try:
            coroutine.send(None)
        except StopIteration:  # pragma: no cover - HeldService always suspends
            raise AssertionError("the call did not stay in flight") from None
        self.in_flight.append((coroutine, CALLED.pop()))

    @precondition(lambda self: len(self.in_flight) > 0)
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "error", "cancel"]))
    def finish_call(self, data: st.DataObject, outcome: str) -> None:
        coroutine, service = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        _finish(coroutine, service, outcome)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def pick_tables_mirror_the_trackers(self) -> None:
        for balance in (self.sync_balance, self.async_balance):
            assert_flat_mirrors(balance.balance)

    @invariant()
    def no_service_leaks(self) -> None:
        balances = (self.sync_balance, self.async_balance)
        live = {id(ep.service) for b in balances for ep in b.endpoints}
        tracker_of = self.factory.tracker_of
        busy = {
            id(s)
            for s in self.factory.created
            if (tracker := tracker_of.get(id(s))) is not None and tracker.in_flight > 0
        }
        for service in self.factory.created:
            if id(service) in live or id(service) in busy:
                assert service.closed == 0, service
            else:
                assert service.closed == 1, (service.key, service.number, service.closed)

    def teardown(self) -> None:
        while self.in_flight:
            _finish(*self.in_flight.pop(), "ok")
        # Every guard ended; every service not live is closed exactly once.
        assert all(t.in_flight == 0 for t in self.factory.trackers)
        self.no_service_leaks()
        for balance in (self.sync_balance, self.async_balance):
            balance.close()
        assert all(s.closed == 1 for s in self.factory.created)


def _finish(coroutine: Coroutine[Any, Any, object], service: HeldService, outcome: str) -> None:
    if outcome == "cancel":
        coroutine.close()  # GeneratorExit at the await: the guard is cancelled
        return
    service.fail_next_call = outcome == "error"
    try:
        coroutine.send(None)
    except StopIteration:
        assert outcome == "ok"
    except EndpointError:
        assert outcome == "error"
    else:  # pragma: no cover
        raise AssertionError("the call did not finish")
    finally:
        service.fail_next_call = False


ReconcileMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_reconcile_machine = ReconcileMachine.TestCase
