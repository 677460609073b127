"""Balance membership: push, remove, replace_endpoints, endpoint_mut, eligibility."""

from __future__ import annotations

import anyio
import pytest

from poise import (
    Balance,
    ConcurrencyLimit,
    DuplicateIdentity,
    Endpoint,
    InvalidInput,
    ReadinessState,
    service_fn,
)

from ._balance_support import Ctl, First, Recorder, ctl, endpoints, state, states, until


async def _echo(x: object) -> object:
    return x


async def test_push_enters_idle_and_returns_the_index() -> None:
    balance: Balance[object, object] = Balance(First(), endpoints("a"))
    await balance.ready()
    (b,) = endpoints("b")
    assert balance.push(b) == 1
    assert b.state is ReadinessState.IDLE and b.index == 1
    assert [ep.key for ep in balance.endpoints] == ["a", "b"]
    await balance.ready()
    assert states(balance) == {"a": "ready", "b": "ready"}


async def test_an_endpoint_that_failed_elsewhere_enters_idle() -> None:
    (a,) = endpoints("a")
    ctl(a).mode = "fail"
    balance: Balance[object, object] = Balance(First(), [a, *endpoints("b")])
    await balance.ready()
    assert a.state is ReadinessState.FAILED
    assert balance.remove("a") is a
    assert a.index is None
    other: Balance[object, object] = Balance(First())
    other.push(a)
    assert state(a) is ReadinessState.IDLE and a.error is None


def test_duplicate_identity_is_rejected_everywhere() -> None:
    with pytest.raises(DuplicateIdentity):
        Balance(First(), [*endpoints("a"), *endpoints("a")])
    balance: Balance[object, object] = Balance(First(), endpoints("a", "b"))
    with pytest.raises(DuplicateIdentity) as info:
        balance.push(endpoints("a")[0])
    assert info.value.key == "a"
    with pytest.raises(DuplicateIdentity):
        balance.replace_endpoints([*endpoints("x"), *endpoints("x")])
    assert [ep.key for ep in balance.endpoints] == ["a", "b"]


def test_an_endpoint_belongs_to_one_balance() -> None:
    (a,) = endpoints("a")
    Balance(First(), [a])
    other: Balance[object, object] = Balance(First())
    with pytest.raises(InvalidInput, match="belongs"):
        other.push(a)
    with pytest.raises(InvalidInput, match="belongs"):
        other.replace_endpoints([a])
    with pytest.raises(InvalidInput):
        other.push("a")  # type: ignore[arg-type]


async def test_remove_by_key_and_by_index_shifts_indices_and_releases_reservations() -> None:
    eps = endpoints("a", "b", "c", "d")
    balance: Balance[object, object] = Balance(First(), eps)
    await balance.ready()
    removed = balance.remove("b")
    assert removed is eps[1]
    assert ctl(removed).released == 1 and ctl(removed).reserved == 0
    assert removed.state is ReadinessState.IDLE and removed.index is None
    assert [ep.index for ep in balance.endpoints] == [0, 1, 2]
    assert balance.remove(2) is eps[3]
    assert [ep.key for ep in balance.endpoints] == ["a", "c"]
    with pytest.raises(InvalidInput, match="no endpoint"):
        balance.remove("zzz")
    with pytest.raises(InvalidInput, match="no endpoint"):
        balance.remove(5)
    with pytest.raises(InvalidInput, match="hashable"):
        balance.remove(["a"])  # type: ignore[arg-type]
    # The remaining ones are still READY and in order.
    assert await balance.call("x") == ("a", "x")


def test_int_keys_win_over_indices() -> None:
    eps = [Endpoint(k, Ctl(str(k))) for k in (10, 0, 1)]
    balance: Balance[object, object] = Balance(First(), eps)
    assert balance.endpoint(0) is eps[1]  # key 0, not index 0
    assert balance.endpoint(2) is eps[2]  # no key 2: index 2
    assert balance.remove(1) is eps[2]


async def test_removal_leaves_in_flight_guards_alone() -> None:
    (a,) = endpoints("a")
    rec = Recorder()
    a = a.with_tracker(rec)
    ctl(a).block = anyio.Event()
    balance: Balance[object, object] = Balance(First(), [a, *endpoints("b")])
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.dispatch, "x")
        await until(lambda: ctl(a).calls == ["x"])
        balance.remove("a")
        assert rec.events == [("start",)]
        assert balance.statistics().in_flight == 1
        ctl(a).block.set()  # type: ignore[union-attr]
    assert rec.events == [("start",), ("complete", "ok")]
    assert a.load(0.0) == 0
    assert balance.statistics().in_flight == 0


async def test_endpoint_mut_invalidates_the_reservation_and_releases_the_permit() -> None:
    limited = ConcurrencyLimit(service_fn(_echo), 1)
    balance: Balance[object, object] = Balance(First(), [Endpoint("a", limited)])
    await balance.ready()
    assert limited.reserved == 1
    ep = balance.endpoint_mut("a")
    assert ep.state is ReadinessState.IDLE
    assert limited.reserved == 0 and limited.available == 1
    await balance.ready()
    assert limited.reserved == 1


async def test_reading_an_endpoint_does_not_touch_its_reservation() -> None:
    (a,) = endpoints("a")
    balance: Balance[object, object] = Balance(First(), [a])
    await balance.ready()
    assert balance.endpoint("a") is a and balance.endpoints == (a,)
    assert a.state is ReadinessState.READY and ctl(a).released == 0


async def test_replacing_a_service_releases_the_old_reservation() -> None:
    (a,) = endpoints("a")
    old = ctl(a)
    balance: Balance[object, object] = Balance(First(), [a])
    await balance.ready()
    new = Ctl("a2")
    a.service = new
    assert old.released == 1 and a.state is ReadinessState.IDLE
    assert await balance.dispatch("x") == ("a2", "x")


async def test_replacing_a_failed_service_keeps_the_quarantine() -> None:
    (a,) = endpoints("a")
    ctl(a).mode = "fail"
    balance: Balance[object, object] = Balance(First(), [a, *endpoints("b")])
    await balance.ready()
    a.service = Ctl("a2")
    assert a.state is ReadinessState.FAILED
    balance.reset("a")
    await balance.ready()
    assert state(a) is ReadinessState.READY


async def test_ineligible_endpoint_is_drained_at_once() -> None:
    eps = endpoints("a", "b")
    balance: Balance[object, object] = Balance(First(), eps)
    await balance.ready()
    eps[0].eligible = False
    # Its reservation is returned and the next call goes elsewhere.
    assert eps[0].state is ReadinessState.IDLE and ctl(eps[0]).released == 1
    assert await balance.call("x") == ("b", "x")
    await balance.ready()
    assert ctl(eps[0]).polls == 1  # ineligible endpoints are not polled
    assert balance.statistics().ineligible == 1
    eps[0].eligible = True
    assert await balance.dispatch("y") == ("a", "y")


async def test_becoming_eligible_wakes_a_waiting_ready() -> None:
    eps = endpoints("a", "b")
    eps[0].eligible = False
    ctl(eps[1]).mode = "pending"
    balance: Balance[object, object] = Balance(First(), eps)
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.ready)
        await anyio.wait_all_tasks_blocked()
        eps[0].eligible = True
    assert eps[0].state is ReadinessState.READY


async def test_replace_endpoints_keeps_retained_state() -> None:
    a, b, c = endpoints("a", "b", "c")
    ctl(b).mode = "fail"
    rec = Recorder()
    c = c.with_tracker(rec)
    ctl(c).block = anyio.Event()
    balance: Balance[object, object] = Balance(First(), [c, a, b])
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.dispatch, "x")
        await until(lambda: ctl(c).calls == ["x"])
        await balance.ready()
        assert states(balance) == {"c": "ready", "a": "ready", "b": "failed"}
        (d,) = endpoints("d")
        balance.replace_endpoints([b, d, a, c])
        # Retained objects keep READY (no re-poll), FAILED and their tracker.
        assert states(balance) == {"b": "failed", "d": "idle", "a": "ready", "c": "ready"}
        assert [ep.index for ep in (b, d, a, c)] == [0, 1, 2, 3]
        assert ctl(a).polls == 1 and ctl(a).reserved == 1 and ctl(a).released == 0
        assert c.tracker is rec and c.load(0.0) == 1
        ctl(c).block.set()  # type: ignore[union-attr]
    assert rec.events == [("start",), ("complete", "ok")]
    # The ready list follows the new order.
    policy = First()
    balance._policy = policy
    await balance.dispatch("y")
    assert policy.seen[0][0] == ["d", "a", "c"]


async def test_replace_endpoints_detaches_dropped_ones() -> None:
    a, b = endpoints("a", "b")
    balance: Balance[object, object] = Balance(First(), [a, b])
    await balance.ready()
    a2 = Endpoint("a", Ctl("a2"))  # same key, new object: a rebuild
    balance.replace_endpoints([a2, b])
    assert a.index is None and ctl(a).released == 1
    assert a2.state is ReadinessState.IDLE and b.state is ReadinessState.READY
    assert balance.endpoint("a") is a2
    # A detached endpoint can join another balance.
    Balance(First(), [a])


async def test_failed_replace_changes_nothing() -> None:
    a, b = endpoints("a", "b")
    balance: Balance[object, object] = Balance(First(), [a, b])
    await balance.ready()
    foreign = endpoints("z")
    Balance(First(), foreign)
    for bad in ([b, *endpoints("b")], [a, *foreign], [a, "b"]):
        with pytest.raises(InvalidInput):
            balance.replace_endpoints(bad)  # type: ignore[arg-type]
        assert balance.endpoints == (a, b)
        assert states(balance) == {"a": "ready", "b": "ready"}
        assert ctl(a).released == 0 and ctl(b).released == 0


async def test_replace_with_nothing_empties_the_pool() -> None:
    a, b = endpoints("a", "b")
    balance: Balance[object, object] = Balance(First(), [a, b])
    await balance.ready()
    balance.replace_endpoints([])
    assert len(balance) == 0 and ctl(a).released == 1 and ctl(b).released == 1
    from poise import SelectionError

    with pytest.raises(SelectionError):
        await balance.ready()


def test_membership_cannot_change_during_a_scan() -> None:
    class Meddler(Ctl):
        def poll_ready(self, wake):
            assert balance is not None
            balance.push(endpoints("late")[0])
            return True

    balance: Balance[object, object] | None = None
    balance = Balance(First(), [Endpoint("m", Meddler("m"))])
    from poise import ReadinessError

    # The refusal is that service's readiness failure: it is quarantined.
    with pytest.raises(ReadinessError) as info:
        balance.ready_nowait()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "during a readiness scan" in str(info.value.__cause__)
    assert [ep.key for ep in balance.endpoints] == ["m"]


def test_endpoint_carries_opaque_metadata_and_defaults() -> None:
    marker = object()
    ep: Endpoint[object, object] = Endpoint("a", Ctl(), metadata=marker)
    assert ep.metadata is marker and ep.weight == 1.0 and ep.eligible
    assert ep.index is None and ep.state is ReadinessState.IDLE and ep.error is None
    ep.metadata = {"zone": "west"}
    assert ep.metadata == {"zone": "west"}
    copy = ep.with_tracker(Recorder())
    assert copy is not ep and copy.metadata == {"zone": "west"} and copy.service is ep.service
    assert "key='a'" in repr(ep)
    ep.eligible = False
    assert "ineligible" in repr(ep)


def _edit_push(balance: Balance[object, object]) -> None:
    balance.push(endpoints("b")[0])


def _edit_remove(balance: Balance[object, object]) -> None:
    balance.remove("a")


def _edit_endpoint_mut(balance: Balance[object, object]) -> None:
    a = balance.endpoint("a")
    ctl(a).mode = "ready"  # changed in place, without the service's own wake
    balance.endpoint_mut("a")


def _edit_service(balance: Balance[object, object]) -> None:
    balance.endpoint("a").service = Ctl("a2")


def _edit_replace(balance: Balance[object, object]) -> None:
    balance.replace_endpoints([balance.endpoint("a"), *endpoints("b")])


def _edit_splice(balance: Balance[object, object]) -> None:
    balance.splice(appended=endpoints("b"))


MEMBERSHIP_EDITS = {
    "push": (_edit_push, "ready"),
    "remove": (_edit_remove, "SelectionError"),
    "endpoint_mut": (_edit_endpoint_mut, "ready"),
    "service": (_edit_service, "ready"),
    "replace_endpoints": (_edit_replace, "ready"),
    "splice": (_edit_splice, "ready"),
}


@pytest.mark.parametrize("edit", sorted(MEMBERSHIP_EDITS))
async def test_membership_edits_wake_a_waiting_ready(edit: str) -> None:
    change, expected = MEMBERSHIP_EDITS[edit]
    balance: Balance[object, object] = Balance(First(), endpoints("a", mode="pending"))
    outcome: list[str] = []

    async def waiter() -> None:
        try:
            await balance.ready()
        except Exception as exc:
            outcome.append(type(exc).__name__)
        else:
            outcome.append("ready")

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert outcome == []  # waiting on the pending endpoint
        change(balance)
        await anyio.wait_all_tasks_blocked()
        # Nothing but the edit itself woke the waiter: without that wake it
        # would still be waiting here.
        tg.cancel_scope.cancel()
    assert outcome == [expected]
