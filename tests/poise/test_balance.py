"""Balance: readiness lifecycle, quarantine, selection and load guards."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import anyio
import anyio.lowlevel
import pytest

from poise import (
    Balance,
    BalanceStatistics,
    Endpoint,
    EndpointError,
    InFlight,
    InvalidInput,
    ReadinessError,
    ReadinessState,
    RoundRobin,
    SelectionError,
    service_fn,
)

from ._balance_support import Ctl, First, Fixed, Recorder, ctl, endpoints, state, states, until

# -- readiness -----------------------------------------------------------------


async def test_ready_scans_idle_endpoints_and_keeps_reservations() -> None:
    eps = endpoints("a", "b", "c")
    balance: Balance[object, object] = Balance(First(), eps)
    assert states(balance) == {"a": "idle", "b": "idle", "c": "idle"}
    await balance.ready()
    assert states(balance) == {"a": "ready", "b": "ready", "c": "ready"}
    assert [ctl(ep).polls for ep in eps] == [1, 1, 1]
    # READY endpoints keep their reservation and are not polled again.
    await balance.ready()
    assert balance.ready_nowait()
    assert [ctl(ep).polls for ep in eps] == [1, 1, 1]
    assert [ctl(ep).reserved for ep in eps] == [1, 1, 1]


async def test_selected_endpoint_goes_back_to_idle_and_is_polled_again() -> None:
    eps = endpoints("a", "b")
    balance: Balance[object, object] = Balance(First(), eps)
    await balance.ready()
    assert await balance.call("x") == ("a", "x")
    assert states(balance) == {"a": "idle", "b": "ready"}
    await balance.ready()
    assert [ctl(ep).polls for ep in eps] == [2, 1]
    assert states(balance) == {"a": "ready", "b": "ready"}


async def test_each_endpoint_has_its_own_wake_and_waits_for_it() -> None:
    eps = endpoints("a", "b", "c", mode="pending")
    balance: Balance[object, object] = Balance(First(), eps)
    assert balance.ready_nowait() is False
    # A pending endpoint is parked: the next scan does not poll it again.
    assert balance.ready_nowait() is False
    assert [ctl(ep).polls for ep in eps] == [1, 1, 1]
    assert balance.statistics().pending == 3
    wakes = [w for ep in eps for w in ctl(ep).wakes]
    assert len(wakes) == 3 and len({id(w) for w in wakes}) == 3
    # The same function every time for one endpoint: it is made once.
    ctl(eps[1]).wakes[0]()
    assert balance.ready_nowait() is False
    assert [ctl(ep).polls for ep in eps] == [1, 2, 1]
    assert ctl(eps[1]).wakes[1] is ctl(eps[1]).wakes[0]
    # balance.wake() brings every parked endpoint back.
    balance.wake()
    assert balance.ready_nowait() is False
    assert [ctl(ep).polls for ep in eps] == [2, 3, 2]


def test_the_scan_allocates_nothing_per_endpoint() -> None:
    def peak_of_scan(n: int) -> int:
        eps = endpoints(*(f"e{i}" for i in range(n)), mode="pending")
        for ep in eps:
            # A pending service that remembers nothing: only the scan allocates.
            ep.service.poll_ready = lambda wake: False  # type: ignore[method-assign]
        balance: Balance[object, object] = Balance(First(), eps, clock=lambda: 0.0)
        balance.ready_nowait()  # parks every endpoint (one entry each, once)
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            for _ in range(3):
                assert balance.ready_nowait() is False
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return peak - before

    small, large = peak_of_scan(10), peak_of_scan(1000)
    assert large <= small + 256, (small, large)
    # An absolute bound too: three scans allocate no more than a few small
    # objects of tracemalloc's own bookkeeping, whatever the size.
    assert small <= 256 and large <= 256, (small, large)


async def test_pending_endpoint_wakes_a_waiting_ready() -> None:
    (ep,) = endpoints("a", mode="pending")
    balance: Balance[object, object] = Balance(First(), [ep])
    done = anyio.Event()

    async def waiter() -> None:
        await balance.ready()
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert not done.is_set()
        assert ctl(ep).polls == 1
        await anyio.wait_all_tasks_blocked()
        assert ctl(ep).polls == 1  # no polling while nothing woke the balance
        ctl(ep).make_ready()
    assert done.is_set()
    assert ep.state is ReadinessState.READY
    assert ctl(ep).polls == 2


async def test_a_wake_during_the_scan_is_not_lost() -> None:
    class WakesAtOnce(Ctl):
        def poll_ready(self, wake: Callable[[], None]) -> bool:
            if self.polls == 0:
                self.polls += 1
                wake()  # readiness changed already; poll me again
                return False
            return super().poll_ready(wake)

    svc = WakesAtOnce("a")
    balance: Balance[object, object] = Balance(First(), [Endpoint("a", svc)])
    with anyio.fail_after(5):
        await balance.ready()
    assert svc.reserved == 1


async def test_ready_always_checkpoints() -> None:
    balance: Balance[object, object] = Balance(First(), endpoints("a"))
    await balance.ready()
    reached = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        await balance.ready()  # already ready, yet cancellation is seen
        reached = True
    assert not reached
    with anyio.CancelScope() as scope:
        scope.cancel()
        await balance.dispatch("x")
        reached = True
    assert not reached


async def test_dispatch_waits_for_readiness_then_calls() -> None:
    (ep,) = endpoints("a", mode="pending")
    balance: Balance[object, object] = Balance(First(), [ep])
    results: list[object] = []

    async def caller() -> None:
        results.append(await balance.dispatch("r"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await anyio.wait_all_tasks_blocked()
        assert results == []
        ctl(ep).make_ready()
    assert results == [("a", "r")]


# -- quarantine ----------------------------------------------------------------


async def test_a_failed_poll_quarantines_one_endpoint_and_the_pool_stays_ready() -> None:
    eps = endpoints("a", "b")
    ctl(eps[0]).mode = "fail"
    seen: list[tuple[int, object, Exception]] = []
    balance: Balance[object, object] = Balance(
        First(), eps, readiness_observer=lambda i, k, e: seen.append((i, k, e))
    )
    await balance.ready()
    assert states(balance) == {"a": "failed", "b": "ready"}
    assert eps[0].error is ctl(eps[0]).error
    assert seen == [(0, "a", ctl(eps[0]).error)]
    # FAILED endpoints are not polled again, even after they would recover.
    ctl(eps[0]).mode = "ready"
    assert await balance.dispatch("x") == ("b", "x")
    await balance.ready()
    assert ctl(eps[0]).polls == 1
    assert eps[0].state is ReadinessState.FAILED


async def test_exhausting_the_pool_raises_readiness_error_with_index_and_key() -> None:
    eps = endpoints("a", "b", "c")
    ctl(eps[0]).mode = "fail"
    ctl(eps[2]).mode = "fail"
    ctl(eps[1]).mode = "pending"
    seen: list[tuple[int, object]] = []
    balance: Balance[object, object] = Balance(
        First(), eps, readiness_observer=lambda i, k, e: seen.append((i, k))
    )
    assert balance.ready_nowait() is False  # b is pending: not exhausted yet
    ctl(eps[1]).mode = "fail"
    with pytest.raises(ReadinessError) as info:
        await balance.ready()
    assert info.value.index == 1 and info.value.key == "b"
    assert info.value.__cause__ is ctl(eps[1]).error
    assert sorted(seen) == [(0, "a"), (1, "b"), (2, "c")]
    # Later scans report the exhausted pool as a selection error.
    with pytest.raises(SelectionError, match="3 failed"):
        await balance.ready()


async def test_reset_brings_failed_endpoints_back() -> None:
    eps = endpoints("a", "b", "c")
    for ep in eps:
        ctl(ep).mode = "fail"
    balance: Balance[object, object] = Balance(First(), eps)
    with pytest.raises(ReadinessError):
        await balance.ready()
    for ep in eps:
        ctl(ep).mode = "ready"
    balance.reset("b")
    assert eps[1].state is ReadinessState.IDLE and eps[1].error is None
    await balance.ready()
    assert states(balance) == {"a": "failed", "b": "ready", "c": "failed"}
    balance.reset(0)  # by index
    assert eps[0].state is ReadinessState.IDLE
    balance.reset("b")  # not failed: no-op
    assert state(eps[1]) is ReadinessState.READY
    assert balance.reset_all() == 1
    await balance.ready()
    assert states(balance) == {"a": "ready", "b": "ready", "c": "ready"}


async def test_reset_wakes_a_waiting_ready() -> None:
    eps = endpoints("a", "b")
    ctl(eps[0]).mode = "fail"
    ctl(eps[1]).mode = "pending"
    balance: Balance[object, object] = Balance(First(), eps)
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.ready)
        await anyio.wait_all_tasks_blocked()
        ctl(eps[0]).mode = "ready"
        balance.reset("a")
    assert eps[0].state is ReadinessState.READY


async def test_empty_balance_raises_selection_error() -> None:
    balance: Balance[object, object] = Balance(First())
    with pytest.raises(SelectionError, match="no endpoints"):
        await balance.ready()
    with pytest.raises(SelectionError, match="no endpoints"):
        await balance.dispatch("x")
    with pytest.raises(SelectionError):
        balance.ready_nowait()


async def test_all_ineligible_raises_selection_error() -> None:
    eps = endpoints("a", "b")
    for ep in eps:
        ep.eligible = False
    balance: Balance[object, object] = Balance(First(), eps)
    with pytest.raises(SelectionError, match="2 ineligible"):
        await balance.ready()
    assert [ctl(ep).polls for ep in eps] == [0, 0]


# -- selection and dispatch ----------------------------------------------------


async def test_call_without_reservation_is_a_selection_error() -> None:
    eps = endpoints("a")
    balance: Balance[object, object] = Balance(First(), eps)
    with pytest.raises(SelectionError, match="reservation"):
        await balance.call("x")
    assert ctl(eps[0]).calls == [] and ctl(eps[0]).polls == 0
    await balance.ready()
    await balance.call("x")
    with pytest.raises(SelectionError):
        await balance.call("y")  # the reservation was consumed
    assert ctl(eps[0]).calls == ["x"]


async def test_policy_sees_ready_endpoints_in_order_and_unit_context() -> None:
    eps = endpoints("a", "b", "c", "d")
    ctl(eps[1]).mode = "pending"
    policy = First()
    balance: Balance[object, object] = Balance(policy, eps)
    await balance.dispatch("x")
    ctl(eps[1]).make_ready()
    await balance.dispatch("y")
    assert policy.seen == [(["a", "c", "d"], None), (["a", "b", "c", "d"], None)]


async def test_round_robin_rotates_in_endpoint_order() -> None:
    balance: Balance[object, object] = Balance(RoundRobin(), endpoints("a", "b", "c"))
    names = [(await balance.dispatch(i))[0] for i in range(7)]  # type: ignore[index]
    assert names == ["a", "b", "c", "a", "b", "c", "a"]


async def test_out_of_range_pick_is_a_selection_error_and_changes_nothing() -> None:
    eps = endpoints("a", "b")
    balance: Balance[object, object] = Balance(Fixed(2), eps)
    await balance.ready()
    with pytest.raises(SelectionError, match="index 2"):
        await balance.call("x")
    balance2: Balance[object, object] = Balance(Fixed(-1), endpoints("a"))
    await balance2.ready()
    with pytest.raises(SelectionError):
        await balance2.call("x")
    assert states(balance) == {"a": "ready", "b": "ready"}
    assert all(ep.tracker.load(0.0) == 0 for ep in eps)


async def test_guard_is_taken_before_the_service_is_called_and_completed_after() -> None:
    eps = endpoints("a")
    rec = Recorder()
    ep = eps[0].with_tracker(rec)
    ctl(ep).endpoint = ep
    balance: Balance[object, object] = Balance(First(), [ep])
    assert await balance.dispatch("x") == ("a", "x")
    assert ctl(ep).observed_load == [1.0]  # the guard was open during the call
    assert rec.events == [("start",), ("complete", "ok")]
    assert ep.load(0.0) == 0


async def test_service_error_completes_guard_as_failed_and_keeps_dispatch_index() -> None:
    eps = endpoints("a", "b", "c")
    rec = Recorder()
    eps[2] = eps[2].with_tracker(rec)
    boom = ValueError("boom")
    ctl(eps[2]).raise_on_call = boom
    balance: Balance[object, object] = Balance(Fixed(2), eps)
    await balance.ready()
    with pytest.raises(EndpointError) as info:
        await balance.call("x")
    assert info.value.index == 2 and info.value.key == "c"
    assert info.value.__cause__ is boom
    assert rec.events == [("start",), ("complete", "failed")]
    assert balance.statistics().in_flight == 0


async def test_error_index_is_the_dispatch_time_index() -> None:
    eps = endpoints("a", "b", "c")
    ctl(eps[2]).block = anyio.Event()
    ctl(eps[2]).raise_on_call = ValueError("late")
    balance: Balance[object, object] = Balance(Fixed(2), eps)
    errors: list[EndpointError] = []

    async def caller() -> None:
        try:
            await balance.dispatch("x")
        except EndpointError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await until(lambda: ctl(eps[2]).calls == ["x"])
        balance.remove("a")  # c moves from index 2 to 1 while the call runs
        assert eps[2].index == 1
        ctl(eps[2]).block.set()  # type: ignore[union-attr]
    assert errors[0].index == 2 and errors[0].key == "c"


async def test_cancelled_caller_cancels_the_guard() -> None:
    eps = endpoints("a")
    rec = Recorder()
    ep = eps[0].with_tracker(rec)
    ctl(ep).block = anyio.Event()
    balance: Balance[object, object] = Balance(First(), [ep])
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.dispatch, "x")
        await until(lambda: ctl(ep).calls == ["x"])
        assert ep.load(0.0) == 1
        assert balance.statistics().in_flight == 1
        tg.cancel_scope.cancel()
    assert rec.events == [("start",), ("cancel",)]
    assert ep.load(0.0) == 0
    assert balance.statistics().in_flight == 0


async def test_cancelled_call_after_ready_cancels_the_guard() -> None:
    rec = Recorder()
    ep = endpoints("a")[0].with_tracker(rec)
    ctl(ep).block = anyio.Event()
    balance: Balance[object, object] = Balance(First(), [ep])
    await balance.ready()
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.call, "x")
        await until(lambda: ctl(ep).calls == ["x"])
        assert balance.statistics().in_flight == 1
        tg.cancel_scope.cancel()
    assert rec.events == [("start",), ("cancel",)]
    assert ep.load(0.0) == 0
    assert balance.statistics().in_flight == 0


async def _cancel_when(scope: anyio.CancelScope, predicate: Callable[[], bool]) -> None:
    await until(predicate)
    scope.cancel()


async def test_cancelled_caller_releases_inflight_load() -> None:
    (ep,) = endpoints("a")
    ctl(ep).block = anyio.Event()
    balance: Balance[object, object] = Balance(First(), [ep])
    assert isinstance(ep.tracker, InFlight)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_when, scope, lambda: ctl(ep).calls == ["x"])
            await balance.dispatch("x")
    assert scope.cancelled_caught
    assert ctl(ep).calls == ["x"]
    assert ep.tracker.in_flight == 0 and ep.load(0.0) == 0


async def test_load_comes_only_from_the_tracker() -> None:
    class Lowest:
        def pick(self, ready, context, now):
            loads = [ep.load(now) for ep in ready]
            return loads.index(min(loads))

    eps = endpoints("a", "b", "c")
    eps = [ep.with_tracker(Recorder(load)) for ep, load in zip(eps, [5.0, 1.0, 3.0], strict=True)]
    balance: Balance[object, object] = Balance(Lowest(), eps)
    assert (await balance.dispatch("x"))[0] == "b"  # type: ignore[index]
    assert eps[1].load(0.0) == 1.0 and eps[1].tracker is not eps[0].tracker


# -- streaming responses -------------------------------------------------------


async def test_open_holds_the_guard_until_the_block_exits() -> None:
    eps = endpoints("a")
    rec = Recorder()
    ep = eps[0].with_tracker(rec)
    balance: Balance[object, object] = Balance(First(), [ep])
    async with balance.open("x") as response:
        assert response == ("a", "x")
        assert ep.load(0.0) == 1
        assert rec.events == [("start",)]
        assert balance.statistics().in_flight == 1
    assert rec.events == [("start",), ("complete", "ok")]
    assert balance.statistics().in_flight == 0


async def test_open_body_error_completes_as_failed_and_propagates_unchanged() -> None:
    rec = Recorder()
    ep = endpoints("a")[0].with_tracker(rec)
    balance: Balance[object, object] = Balance(First(), [ep])
    with pytest.raises(KeyError):
        async with balance.open("x"):
            raise KeyError("body")
    assert rec.events == [("start",), ("complete", "failed")]


async def test_open_cancelled_body_cancels_the_guard() -> None:
    rec = Recorder()
    ep = endpoints("a")[0].with_tracker(rec)
    balance: Balance[object, object] = Balance(First(), [ep])
    with anyio.CancelScope() as scope:
        async with balance.open("x"):
            assert rec.events == [("start",)]
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert rec.events == [("start",), ("cancel",)]
    assert ep.load(0.0) == 0


async def test_open_service_error_is_an_endpoint_error() -> None:
    rec = Recorder()
    ep = endpoints("a")[0].with_tracker(rec)
    ctl(ep).raise_on_call = OSError("reset")
    balance: Balance[object, object] = Balance(First(), [ep])
    with pytest.raises(EndpointError) as info:
        async with balance.open("x"):
            raise AssertionError("not reached")
    assert info.value.key == "a" and isinstance(info.value.__cause__, OSError)
    assert rec.events == [("start",), ("complete", "failed")]
    assert balance.statistics().in_flight == 0


# -- sharing a balance between tasks --------------------------------------------


async def test_concurrent_dispatchers_respect_reservations() -> None:
    from poise import ConcurrencyLimit

    running = {"a": 0, "b": 0}
    peak = {"a": 0, "b": 0}

    def make(name: str) -> Endpoint[int, int]:
        async def work(x: int) -> int:
            running[name] += 1
            peak[name] = max(peak[name], running[name])
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
            running[name] -= 1
            return x

        return Endpoint(name, ConcurrencyLimit(service_fn(work), 1))

    balance: Balance[int, int] = Balance(RoundRobin(), [make("a"), make("b")])
    results: list[int] = []

    async def caller(i: int) -> None:
        results.append(await balance.dispatch(i))

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(caller, i)
    assert sorted(results) == list(range(20))
    assert peak == {"a": 1, "b": 1}
    assert balance.statistics().in_flight == 0


# -- looking at it -------------------------------------------------------------


async def test_statistics_and_repr() -> None:
    eps = endpoints("a", "b", "c", "d")
    ctl(eps[0]).mode = "fail"
    ctl(eps[1]).mode = "pending"
    eps[3].eligible = False
    ctl(eps[2]).block = anyio.Event()
    balance: Balance[object, object] = Balance(First(), eps)
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.dispatch, "x")
        await until(lambda: ctl(eps[2]).calls == ["x"])
        stats = balance.statistics()
        assert stats == BalanceStatistics(
            endpoints=4, idle=3, ready=0, failed=1, ineligible=1, in_flight=1, pending=1
        )
        assert "pending=1" in repr(balance)
        assert "in_flight=1" in repr(balance) and "failed=1" in repr(balance)
        ctl(eps[2]).block.set()  # type: ignore[union-attr]
    with pytest.raises(AttributeError):
        stats.ready = 3  # type: ignore[misc]


# -- bad input -----------------------------------------------------------------


@pytest.mark.parametrize("weight", [0, -1.0, float("nan"), float("inf"), "1", True, None])
def test_bad_weights_are_rejected_where_they_enter(weight: object) -> None:
    with pytest.raises(InvalidInput, match="weight"):
        Endpoint("a", Ctl(), weight=weight)  # type: ignore[arg-type]
    ep = Endpoint("a", Ctl(), weight=2)
    with pytest.raises(InvalidInput, match="weight"):
        ep.weight = weight  # type: ignore[assignment]
    assert ep.weight == 2.0


@pytest.mark.parametrize("service", [object(), 42, service_fn, "poll_ready"])
def test_an_endpoint_needs_a_service(service: object) -> None:
    with pytest.raises(InvalidInput, match=r"poll_ready\(\) and call\(\)"):
        Endpoint("a", service)  # type: ignore[arg-type]
    ep = Endpoint("a", Ctl())
    balance: Balance[object, object] = Balance(First(), [ep])
    assert balance.ready_nowait() and ctl(ep).reserved == 1
    with pytest.raises(InvalidInput, match="lacks"):
        ep.service = service  # type: ignore[assignment]
    # Nothing changed: the old service keeps its reservation.
    assert isinstance(ep.service, Ctl) and ctl(ep).reserved == 1
    assert state(ep) is ReadinessState.READY


class _HalfService:
    def poll_ready(self, wake: Callable[[], None]) -> bool:
        return True


def test_a_service_without_call_is_named() -> None:
    with pytest.raises(InvalidInput, match=r"_HalfService lacks call\(\)"):
        Endpoint("a", _HalfService())  # type: ignore[arg-type]


@pytest.mark.parametrize("index", [0.0, 1.5, True, None, "0"])
async def test_a_non_int_pick_is_a_selection_error_naming_the_policy(index: object) -> None:
    class Sloppy:
        def pick(self, ready: object, context: object, now: float) -> object:
            return index

    eps = endpoints("a", "b")
    balance: Balance[object, object] = Balance(Sloppy(), eps)  # type: ignore[call-overload]
    with pytest.raises(SelectionError, match="policy Sloppy returned a"):
        await balance.dispatch("x")
    with pytest.raises(SelectionError, match="Sloppy"):
        await balance.dispatch_held("x")
    await balance.ready()
    with pytest.raises(SelectionError, match="Sloppy"):
        await balance.call("x")
    # Nothing was called and no load was taken.
    assert [ctl(ep).calls for ep in eps] == [[], []]
    assert all(ep.load(0.0) == 0 for ep in eps)


def test_a_clock_must_be_callable() -> None:
    with pytest.raises(InvalidInput, match="clock"):
        Balance(First(), [], clock=12.0)  # type: ignore[call-overload]


def test_unhashable_keys_and_bad_policies_are_rejected() -> None:
    with pytest.raises(InvalidInput, match="hashable"):
        Endpoint(["a"], Ctl())  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="pick"):
        Balance(object(), [])  # type: ignore[call-overload]
    with pytest.raises(InvalidInput, match="context"):
        Balance(First(), [], context=42)  # type: ignore[call-overload]
