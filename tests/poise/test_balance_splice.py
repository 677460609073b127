"""Balance.splice: the incremental commit, and the reconciler's use of it.

``splice(removed, replaced, appended)`` must leave a balance exactly as
``replace_endpoints`` would with the equivalent whole list: the same order,
states, reservations, quarantines, loads and selections. This module checks
that equivalence on twin balances driven through the same history, extends
the balance and reconciler state machines with splices and hand-built
snapshots, and tests each invariant on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import anyio
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import invariant, rule

from poise import (
    Allocation,
    Backend,
    Balance,
    Directory,
    DiscoveryBalance,
    DuplicateIdentity,
    Endpoint,
    InvalidInput,
    Member,
    ReadinessError,
    ReadinessState,
    ReconcileError,
    RoundRobin,
    SelectionError,
    Snapshot,
    in_flight_factory,
    service_fn,
)
from poise._reconcile import _plan_from_log, _plan_full, plan_reconcile

from ._balance_support import Ctl, First, Recorder, ctl, endpoints, until
from .test_balance_state import KEYS as MACHINE_KEYS
from .test_balance_state import MODES, BalanceMachine
from .test_reconcile_machine import KEYS as DIRECTORY_KEYS
from .test_reconcile_machine import ReconcileMachine
from .test_reconcile_planner import apply_edits, edits, state_from

IDLE = ReadinessState.IDLE
READY = ReadinessState.READY
FAILED = ReadinessState.FAILED

POOL = [f"k{i}" for i in range(10)]


async def _echo(request: object) -> object:
    return request


def _run_call(balance: Balance[object, object], request: object) -> object:
    """Drive ``balance.call`` to completion by hand (Ctl answers without waiting)."""
    coro = balance.call(request)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()  # pragma: no cover - Ctl never suspends without a block
    raise AssertionError("the call suspended")


def _spliced(
    current: Sequence[Endpoint[object, object]],
    removed: set[int],
    replaced: dict[int, Endpoint[object, object]],
    appended: Sequence[Endpoint[object, object]],
) -> list[Endpoint[object, object]]:
    """The whole list a splice describes (positions refer to ``current``)."""
    out = [replaced.get(i, ep) for i, ep in enumerate(current) if i not in removed]
    return out + list(appended)


# -- twins: splice against replace_endpoints ---------------------------------------------------


def _twin_endpoints(spec: Sequence[tuple[str, str, bool]]) -> list[Endpoint[object, object]]:
    out: list[Endpoint[object, object]] = []
    for key, mode, eligible in spec:
        service = Ctl(key, mode)
        ep: Endpoint[object, object] = Endpoint(key, service, eligible=eligible, tracker=Recorder())
        service.endpoint = ep
        out.append(ep)
    return out


def _look(balance: Balance[object, object], extra: Sequence[Endpoint[object, object]]) -> object:
    """Everything observable about a balance and some endpoints, by value."""

    def one(ep: Endpoint[object, object]) -> tuple[object, ...]:
        svc = ctl(ep)
        error = None if ep.error is None else (type(ep.error), str(ep.error))
        return (
            ep.key,
            ep.index,
            ep.state,
            error,
            ep.eligible,
            svc.reserved,
            svc.released,
            svc.polls,
            ep.load(0.0),
        )

    return (
        [one(ep) for ep in balance.endpoints],
        [one(ep) for ep in extra],
        balance.statistics(),
        sorted(str(ep.key) for ep in balance._idle),
    )


def _drive(balance: Balance[object, object], steps: Sequence[tuple[str, int]]) -> list[object]:
    """Scans, calls and mode changes; returns what each step saw."""
    seen: list[object] = []
    for op, arg in steps:
        if op == "scan":
            try:
                seen.append(balance.ready_nowait())
            except (SelectionError, ReadinessError) as exc:
                seen.append(type(exc))
        elif op == "call":
            try:
                seen.append(_run_call(balance, arg))
            except SelectionError as exc:
                seen.append(type(exc))
        elif balance.endpoints:
            ep = balance.endpoints[arg % len(balance.endpoints)]
            ctl(ep).mode = MODES[arg % 3]
            if op == "reset":
                balance.reset(ep.key)
    return seen


modes = st.sampled_from(["ready", "ready", "pending", "fail"])
member_specs = st.lists(
    st.tuples(st.sampled_from(POOL), modes, st.booleans()),
    max_size=8,
    unique_by=lambda spec: spec[0],
)
histories = st.lists(
    st.tuples(st.sampled_from(["scan", "call", "mode", "reset"]), st.integers(0, 20)),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(
    spec=member_specs,
    before=histories,
    after=histories,
    data=st.data(),
)
def test_splice_equals_replace_endpoints(
    spec: list[tuple[str, str, bool]],
    before: list[tuple[str, int]],
    after: list[tuple[str, int]],
    data: st.DataObject,
) -> None:
    left_eps = _twin_endpoints(spec)
    right_eps = _twin_endpoints(spec)
    left: Balance[object, object] = Balance(RoundRobin(), left_eps, clock=lambda: 0.0)
    right: Balance[object, object] = Balance(RoundRobin(), right_eps, clock=lambda: 0.0)
    assert _drive(left, before) == _drive(right, before)
    assert _look(left, []) == _look(right, [])

    n = len(left_eps)
    positions = data.draw(st.permutations(range(n)))
    n_removed = data.draw(st.integers(0, n))
    n_replaced = data.draw(st.integers(0, n - n_removed))
    removed = set(positions[:n_removed])
    replaced_at = positions[n_removed : n_removed + n_replaced]
    new_spec = data.draw(
        st.lists(st.tuples(st.sampled_from(POOL), modes, st.booleans()), max_size=4)
    )
    fresh_spec = new_spec[: len(replaced_at)]
    while len(fresh_spec) < len(replaced_at):
        fresh_spec.append((f"r{len(fresh_spec)}", "ready", True))
    appended_spec = new_spec[len(replaced_at) :]
    by_key = data.draw(st.booleans())

    def target(i: int) -> Hashable:
        return left_eps[i].key if by_key else i

    left_new = _twin_endpoints(fresh_spec + appended_spec)
    right_new = _twin_endpoints(fresh_spec + appended_spec)
    k = len(fresh_spec)
    splice_args = (
        [target(i) for i in sorted(removed)],
        [(target(i), ep) for i, ep in zip(replaced_at, left_new[:k], strict=True)],
        left_new[k:],
    )
    whole = _spliced(
        right_eps, removed, dict(zip(replaced_at, right_new[:k], strict=True)), right_new[k:]
    )
    left_error: type[Exception] | None = None
    right_error: type[Exception] | None = None
    try:
        left.splice(*splice_args)
    except InvalidInput as exc:  # DuplicateIdentity is an InvalidInput
        left_error = type(exc)
    try:
        right.replace_endpoints(whole)
    except InvalidInput as exc:
        right_error = type(exc)
    assert left_error == right_error
    assert _look(left, left_eps + left_new) == _look(right, right_eps + right_new)
    # The same selections follow, in the same order.
    assert _drive(left, after) == _drive(right, after)
    assert _look(left, left_eps + left_new) == _look(right, right_eps + right_new)


# -- the balance state machine, with splices --------------------------------------------------


class SpliceMachine(BalanceMachine):
    """The balance state machine plus random splices, checked against the list they describe."""

    @rule(data=st.data())
    def splice(self, data: st.DataObject) -> None:
        current = list(self.balance.endpoints)
        n = len(current)
        order = data.draw(st.permutations(range(n)))
        n_removed = data.draw(st.integers(0, n))
        n_replaced = data.draw(st.integers(0, n - n_removed))
        removed = set(order[:n_removed])
        replaced_at = order[n_removed : n_removed + n_replaced]
        fresh_keys = data.draw(
            st.lists(st.sampled_from(MACHINE_KEYS), min_size=n_replaced, max_size=n_replaced + 2)
        )
        fresh = [self._new(k, data.draw(st.sampled_from(MODES))) for k in fresh_keys]
        by_key = data.draw(st.booleans())

        def target(i: int) -> Hashable:
            return current[i].key if by_key else i

        replaced = dict(zip(replaced_at, fresh, strict=False))
        appended = fresh[n_replaced:]
        expected = _spliced(current, removed, replaced, appended)
        before = {id(ep): (ep.state, ep.error) for ep in current}
        keys = [ep.key for ep in expected]
        try:
            self.balance.splice(
                [target(i) for i in removed],
                [(target(i), ep) for i, ep in replaced.items()],
                appended,
            )
        except DuplicateIdentity:
            assert len(set(keys)) < len(keys)
            assert list(self.balance.endpoints) == current
            assert all((ep.state, ep.error) == before[id(ep)] for ep in current)
            return
        assert len(set(keys)) == len(keys)
        assert list(self.balance.endpoints) == expected
        kept = {id(ep) for ep in expected}
        for ep in current:
            if id(ep) in kept:
                assert (ep.state, ep.error) == before[id(ep)]
            else:
                assert ep.index is None
        for ep in fresh:
            assert ep.state is IDLE and ep.error is None


SpliceMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_splice_machine = SpliceMachine.TestCase


# -- the reconciler state machine, with hand-built snapshots ----------------------------------


class ReconcileSpliceMachine(ReconcileMachine):
    """The reconciler machine plus hand-built snapshots that reorder members.

    Directory snapshots commit through ``splice``; a hand-built snapshot in
    another order must fall back to a whole-list commit, and the next
    directory snapshot must restore the directory's order.
    """

    @rule(data=st.data())
    def apply_reordered(self, data: st.DataObject) -> None:
        balance = self.sync_balance
        if balance.revision < 0 or balance.revision >= self.directory.revision:
            return
        current = self.directory.snapshot()
        members = data.draw(st.permutations(current.members))
        built = Snapshot(members, revision=current.revision, lineage=current.lineage)
        self.history.append(built)
        old_members = self.applied.get(id(balance), {})
        old_endpoints = {ep.key: ep for ep in balance.endpoints}
        balance.apply_snapshot(built)
        assert [ep.key for ep in balance.endpoints] == [m.key for m in members]
        for ep in balance.endpoints:
            member = built.get(ep.key)
            assert member is not None and ep.eligible is not member.draining
            if old_members.get(ep.key) is member.allocation:
                assert ep is old_endpoints[ep.key]
        self.applied[id(balance)] = {m.key: m.allocation for m in built}
        # Move the directory on, so that its snapshot at this revision (in
        # directory order) is never taken for an equal, no-op revision.
        key = data.draw(st.sampled_from(DIRECTORY_KEYS))
        self.directory.upsert(key, Backend(f"http://{key}"))

    @invariant()
    def balances_consistent(self) -> None:
        for discovery in (self.sync_balance, self.async_balance):
            b = discovery.balance
            members = list(b.endpoints)
            assert [ep.index for ep in members] == list(range(len(members)))
            assert [ep for ep in b._ready if ep.state is READY] == [
                ep for ep in members if ep.state is READY
            ]
            assert all(ep._listed and ep._owner is b for ep in b._ready)
            # The scan walks exactly the IDLE endpoints that can be picked
            # and are not parked waiting for their wake.
            assert {id(ep) for ep in b._idle} == {
                id(ep)
                for ep in members
                if ep.state is IDLE and ep.eligible and not ep.ejected and ep._parked < 0
            }
            assert all(b._idle[ep._slot] is ep for ep in b._idle)
            assert b._parked_count == sum(ep._parked >= 0 for ep in members)
            assert len(b._by_key) == len(members)
            assert all(b._by_key[ep.key] is ep for ep in members)


ReconcileSpliceMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_reconcile_splice_machine = ReconcileSpliceMachine.TestCase


# -- targeted invariants -------------------------------------------------------------------------


async def test_retained_endpoints_keep_reservation_quarantine_and_load() -> None:
    eps = endpoints("a", "b", "c", "d")
    rec = Recorder(load=3.0)
    eps[3] = eps[3].with_tracker(rec)
    ctl(eps[1]).mode = "fail"
    balance: Balance[object, object] = Balance(First(), eps)
    balance.ready_nowait()
    assert [ep.state for ep in eps] == [READY, FAILED, READY, READY]
    (x,) = endpoints("x")
    balance.splice(removed=["c"], replaced=[], appended=[x])
    assert [ep.key for ep in balance.endpoints] == ["a", "b", "d", "x"]
    assert eps[0].state is READY and ctl(eps[0]).reserved == 1 and ctl(eps[0]).released == 0
    assert eps[1].state is FAILED and isinstance(eps[1].error, OSError)
    assert eps[3].state is READY and eps[3].load(0.0) == 3.0
    assert x.state is IDLE
    assert [ep.index for ep in balance.endpoints] == [0, 1, 2, 3]


async def test_new_endpoints_enter_idle_even_after_failing_elsewhere() -> None:
    (old, fresh) = endpoints("a", "b")
    ctl(fresh).mode = "fail"
    elsewhere: Balance[object, object] = Balance(First(), [fresh])
    with pytest.raises(ReadinessError):
        elsewhere.ready_nowait()
    elsewhere.remove("b")
    assert fresh.state is FAILED
    balance: Balance[object, object] = Balance(First(), [old])
    balance.ready_nowait()
    balance.splice(replaced=[("a", fresh)])
    assert fresh.state is IDLE and fresh.error is None and fresh.index == 0
    assert old.index is None and ctl(old).released == 1 and ctl(old).reserved == 0
    ctl(fresh).mode = "ready"
    assert balance.ready_nowait()
    assert await balance.call("x") == ("b", "x")


async def test_departed_endpoints_keep_their_in_flight_guards() -> None:
    (a, b) = endpoints("a", "b")
    rec = Recorder()
    a = a.with_tracker(rec)
    ctl(a).block = anyio.Event()
    balance: Balance[object, object] = Balance(First(), [a, b])
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.dispatch, "x")
        await until(lambda: ctl(a).calls == ["x"])
        (a2,) = endpoints("a")
        balance.splice(replaced=[("a", a2)])
        assert a.index is None and a2.index == 0
        assert rec.events == [("start",)] and balance.statistics().in_flight == 1
        ctl(a).block.set()  # type: ignore[union-attr]
    assert rec.events == [("start",), ("complete", "ok")]
    assert balance.statistics().in_flight == 0 and a.load(0.0) == 0


async def test_ready_list_stays_ordered_for_the_policy() -> None:
    eps = endpoints("a", "b", "c", "d", "e")
    policy = First()
    balance: Balance[object, object] = Balance(policy, eps)
    balance.ready_nowait()
    new_b, new_f = endpoints("b", "f")
    balance.splice(removed=[0, 3], replaced=[(1, new_b)], appended=[new_f])
    assert [ep.key for ep in balance.endpoints] == ["b", "c", "e", "f"]
    # The rebuilt "b" holds its predecessor's place until a scan decides.
    assert balance.ready_nowait()
    await balance.call("x")
    assert policy.seen[-1][0] == ["b", "c", "e", "f"]
    # A replacement that does not become ready is dropped before the next pick.
    (pending_c,) = endpoints("c", mode="pending")
    balance.splice(replaced=[("c", pending_c)])
    assert balance.ready_nowait()
    await balance.call("y")
    assert policy.seen[-1][0] == ["b", "e", "f"]
    assert pending_c.state is IDLE and not pending_c._listed
    assert [ep.key for ep in balance._ready if ep.state is READY] == [
        ep.key for ep in balance.endpoints if ep.state is READY
    ]


async def test_an_ineligible_replacement_is_never_picked() -> None:
    (a, b) = endpoints("a", "b")
    balance: Balance[object, object] = Balance(First(), [a, b])
    balance.ready_nowait()
    (drained,) = endpoints("a")
    drained.eligible = False
    balance.splice(replaced=[("a", drained)])
    assert balance.ready_nowait()
    assert await balance.call("x") == ("b", "x")
    assert drained.state is IDLE and ctl(drained).polls == 0


def test_duplicate_keys_are_refused_and_nothing_changes() -> None:
    eps = endpoints("a", "b", "c")
    balance: Balance[object, object] = Balance(First(), eps)
    balance.ready_nowait()
    with pytest.raises(DuplicateIdentity) as info:
        balance.splice(appended=endpoints("b"))
    assert info.value.key == "b"
    with pytest.raises(DuplicateIdentity):
        balance.splice(removed=["a"], appended=endpoints("x", "x"))
    with pytest.raises(DuplicateIdentity):
        balance.splice(replaced=[("a", endpoints("c")[0])])
    assert list(balance.endpoints) == eps
    assert all(ep.state is READY and ctl(ep).released == 0 for ep in eps)
    # A key that leaves may come back in the same splice.
    (b2, a2) = endpoints("b", "a")
    balance.splice(removed=["b"], replaced=[("a", a2)], appended=[b2])
    assert [ep.key for ep in balance.endpoints] == ["a", "c", "b"]
    assert balance.endpoint("a") is a2 and balance.endpoint("b") is b2


@pytest.mark.parametrize(
    "args",
    [
        pytest.param({"removed": ["zzz"]}, id="unknown-key"),
        pytest.param({"removed": "ab"}, id="one-string"),
        pytest.param({"removed": [7]}, id="index-out-of-range"),
        pytest.param({"removed": [["a"]]}, id="unhashable"),
        pytest.param({"removed": ["a", 0]}, id="same-endpoint-twice"),
        pytest.param({"removed": ["a"], "replaced": [("a", None)]}, id="removed-and-replaced"),
        pytest.param({"replaced": [("a",)]}, id="bad-pair"),
        pytest.param({"appended": ["x"]}, id="not-an-endpoint"),
        pytest.param({"replaced": [("b", "x")]}, id="replacement-not-an-endpoint"),
    ],
)
def test_bad_input_is_refused_before_anything_changes(args: dict[str, Any]) -> None:
    eps = endpoints("a", "b", "c")
    balance: Balance[object, object] = Balance(First(), eps)
    balance.ready_nowait()
    (fresh,) = endpoints("x")
    before = balance.statistics()
    kwargs = {**args, "appended": [fresh, *args.get("appended", [])]}
    with pytest.raises(InvalidInput):
        balance.splice(**kwargs)
    assert list(balance.endpoints) == eps and balance.statistics() == before
    assert fresh.index is None and fresh.state is IDLE
    assert all(ctl(ep).reserved == 1 and ctl(ep).released == 0 for ep in eps)


def test_endpoints_of_a_balance_are_refused() -> None:
    eps = endpoints("a", "b")
    balance: Balance[object, object] = Balance(First(), eps)
    other: Balance[object, object] = Balance(First(), endpoints("x"))
    with pytest.raises(InvalidInput, match="another balance"):
        balance.splice(appended=[other.endpoint("x")])
    with pytest.raises(InvalidInput, match="this balance"):
        balance.splice(removed=["a"], appended=[eps[0]])
    assert list(balance.endpoints) == eps and other.endpoint("x").index == 0


def test_an_empty_splice_changes_nothing() -> None:
    balance: Balance[object, object] = Balance(First(), endpoints("a"))
    count = balance.wake_count
    balance.splice()
    assert balance.wake_count == count and len(balance) == 1


def test_a_failing_release_hook_is_logged_and_the_splice_stands(
    caplog: pytest.LogCaptureFixture,
) -> None:
    eps = endpoints("a", "b", "c")
    balance: Balance[object, object] = Balance(First(), eps)
    balance.ready_nowait()

    def broken() -> None:
        raise RuntimeError("release failed")

    ctl(eps[0]).release_reservation = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="poise._balance"):
        balance.splice(removed=["a", "b"])
    assert [ep.key for ep in balance.endpoints] == ["c"]
    assert ctl(eps[1]).released == 1
    assert eps[0].index is None and eps[0].state is IDLE
    assert "releasing the reservation of endpoint 'a' failed" in caplog.text


def test_membership_cannot_change_during_a_scan() -> None:
    errors: list[BaseException] = []
    balance: Balance[object, object] = Balance(First())

    class Meddler(Ctl):
        def poll_ready(self, wake: Callable[[], None]) -> bool:
            try:
                balance.splice(removed=["b"])
            except RuntimeError as exc:
                errors.append(exc)
            return super().poll_ready(wake)

    balance.replace_endpoints([Endpoint("a", Meddler("a")), *endpoints("b")])
    assert balance.ready_nowait()
    assert len(balance) == 2 and len(errors) == 1 and "readiness scan" in str(errors[0])


async def test_a_splice_wakes_waiting_ready() -> None:
    balance: Balance[object, object] = Balance(First(), endpoints("a", mode="pending"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(balance.ready)
        await until(lambda: balance._event is not None)
        balance.splice(appended=endpoints("b"))
    assert balance.endpoint("b").state is READY


def test_repeated_splices_without_scans_do_not_pile_up() -> None:
    balance: Balance[object, object] = Balance(First(), endpoints(*POOL))
    balance.ready_nowait()
    for _ in range(50):
        balance.splice(replaced=[(key, endpoints(key)[0]) for key in POOL])
    assert len(balance._consumed) <= 2 * len(POOL) + 64
    assert balance.ready_nowait()
    assert len(balance._ready) == len(POOL) and not balance._consumed


async def test_many_replacements_that_stay_pending_leave_the_ready_list() -> None:
    keys = [f"m{i}" for i in range(40)]
    eps = endpoints(*keys)
    policy = First()
    balance: Balance[object, object] = Balance(policy, eps)
    balance.ready_nowait()
    pending = {i: endpoints(keys[i], mode="pending")[0] for i in range(0, 40, 2)}
    balance.splice(replaced=list(pending.items()))
    # No scan in between: the pick itself drops the pending replacements.
    assert await balance.call("x") == ("m1", "x")
    assert policy.seen[-1][0] == keys[1::2]
    assert not any(ep._listed for ep in pending.values())
    assert balance.ready_nowait()
    assert [ep.key for ep in balance._ready] == keys[1::2]
    for ep in pending.values():
        ctl(ep).make_ready()
    assert balance.ready_nowait()
    assert [ep.key for ep in balance._ready] == keys


def test_many_removals_renumber_and_keep_the_ready_order() -> None:
    keys = [f"m{i}" for i in range(200)]
    eps = endpoints(*keys)
    balance: Balance[object, object] = Balance(First(), eps)
    balance.ready_nowait()
    gone = set(range(3, 200, 7))  # more than a few: the lists are rebuilt
    rebuilt = {i: endpoints(keys[i])[0] for i in range(5, 200, 11) if i not in gone}
    tail = endpoints("n0", "n1")
    balance.splice(
        removed=[keys[i] for i in sorted(gone, reverse=True)],
        replaced=[(i, ep) for i, ep in rebuilt.items()],
        appended=tail,
    )
    expected = _spliced(eps, gone, rebuilt, tail)
    assert list(balance.endpoints) == expected
    assert [ep.index for ep in expected] == list(range(len(expected)))
    assert all(eps[i].index is None for i in gone)
    assert balance.ready_nowait()
    assert [ep.key for ep in balance._ready] == [ep.key for ep in expected]


# -- the reconciler commits through splice ---------------------------------------------------


def _discovery() -> tuple[Directory, DiscoveryBalance[object, object]]:
    directory = Directory()
    for key in "abcdef":
        directory.upsert(key, Backend(f"http://{key}"))
    discovery: DiscoveryBalance[object, object] = DiscoveryBalance(
        RoundRobin(), in_flight_factory(lambda key, backend: service_fn(_echo))
    )
    discovery.apply_snapshot(directory.snapshot())
    return directory, discovery


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    used: list[str] = []
    replace, splice = Balance.replace_endpoints, Balance.splice

    def spy_replace(self: Balance[Any, Any], endpoints: Sequence[Endpoint[Any, Any]]) -> None:
        used.append("replace")
        replace(self, endpoints)

    def spy_splice(self: Balance[Any, Any], *args: Any, **kwargs: Any) -> None:
        used.append("splice")
        splice(self, *args, **kwargs)

    monkeypatch.setattr(Balance, "replace_endpoints", spy_replace)
    monkeypatch.setattr(Balance, "splice", spy_splice)
    return used


def test_directory_snapshots_commit_through_splice(monkeypatch: pytest.MonkeyPatch) -> None:
    directory, discovery = _discovery()
    used = _spy(monkeypatch)
    kept = discovery.endpoint("a")
    directory.upsert("b", Backend("http://b2"))  # rebuilt in place
    directory.remove("c")
    directory.remove("d")
    directory.upsert("d", Backend("http://d"))  # rebuilt, moved to the end
    directory.upsert("g", Backend("http://g"))  # added
    directory.drain("e")
    report = discovery.apply_snapshot(directory.snapshot())
    assert used == ["splice"]
    assert [ep.key for ep in discovery.endpoints] == list(directory.snapshot().keys())
    assert discovery.endpoint("a") is kept
    assert (report.rebuilt, report.removed, report.added, report.draining) == (2, 1, 1, 1)
    assert not discovery.endpoint("e").eligible


def test_a_reordering_snapshot_replaces_the_whole_list(monkeypatch: pytest.MonkeyPatch) -> None:
    directory, discovery = _discovery()
    used = _spy(monkeypatch)
    directory.upsert("a", Backend("http://a2"))
    current = directory.snapshot()
    members = list(reversed(current.members))
    discovery.apply_snapshot(Snapshot(members, revision=current.revision, lineage=current.lineage))
    assert used == ["replace"]
    assert [ep.key for ep in discovery.endpoints] == [m.key for m in members]
    # The next directory snapshot restores the directory's order, although
    # its change log names only one key.
    directory.upsert("b", Backend("http://b2"))
    discovery.apply_snapshot(directory.snapshot())
    assert [ep.key for ep in discovery.endpoints] == list(directory.snapshot().keys())
    assert used == ["replace", "replace"]
    directory.upsert("c", Backend("http://c2"))
    discovery.apply_snapshot(directory.snapshot())
    assert used == ["replace", "replace", "splice"]


def test_a_hand_built_snapshot_in_directory_order_still_splices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    directory, discovery = _discovery()
    used = _spy(monkeypatch)
    current = directory.snapshot()
    allocation = Allocation(Backend("http://z"))
    members = [m for m in current.members if m.key != "c"] + [Member("z", allocation)]
    discovery.apply_snapshot(Snapshot(members, revision=9, lineage=current.lineage))
    assert used == ["splice"]
    assert [ep.key for ep in discovery.endpoints] == ["a", "b", "d", "e", "f", "z"]


def test_membership_edited_behind_the_reconciler_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    directory, discovery = _discovery()
    used = _spy(monkeypatch)
    removed = discovery.balance.remove("b")
    intruder = Endpoint("intruder", service_fn(_echo))
    discovery.balance.push(intruder)  # the count of endpoints is unchanged
    directory.upsert("g", Backend("http://g"))
    with pytest.raises(ReconcileError, match="edited outside"):
        discovery.apply_snapshot(directory.snapshot())
    # Neither overwritten nor half-applied: the edit stands, nothing committed.
    assert used == []
    assert discovery.revision == 6
    assert [ep.key for ep in discovery.endpoints] == ["a", "c", "d", "e", "f", "intruder"]
    assert intruder.index == 5 and removed.index is None


@settings(max_examples=150, deadline=None)
@given(before=edits, after=edits)
def test_the_full_comparison_finds_the_same_splice_as_the_log(
    before: list[tuple[str, str]], after: list[tuple[str, str]]
) -> None:
    directory = Directory()
    apply_edits(directory, before)
    old = directory.snapshot()
    apply_edits(directory, after)
    new = directory.snapshot()
    state = state_from(old)
    if plan_reconcile(state, new) is None:
        return
    full = _plan_full(state, new)
    entries = new._changes_since(old.revision)
    assert entries is not None
    logged = _plan_from_log(state, new, entries)
    assert logged is not None
    for plan in (full, logged):
        # Directory snapshots always have the shape of a splice.
        assert plan.departed is not None
        departed = set(plan.departed)
        survivors: list[str | None] = [
            ep for key, ep in zip(old.keys(), state.order, strict=True) if key not in departed
        ]
        for position, member in plan.build[: plan.in_place]:
            assert survivors[position] == state.endpoints[member.key]
            survivors[position] = None
        assert survivors + [None] * (len(plan.build) - plan.in_place) == plan.order
    # Both describe the same edit; the full path may call an in-place
    # rebuild at the very end "departed and appended".
    assert logged.departed is not None and full.departed is not None
    assert set(logged.departed) <= set(full.departed)


def test_without_position_hints_many_departures_replace_the_whole_list() -> None:
    directory = Directory()
    keys = [f"m{i:03d}" for i in range(300)]
    for key in keys:
        directory.upsert(key, Backend(key))
    state = state_from(directory.snapshot())
    for key in keys[:260]:
        directory.remove(key)
    new = directory.snapshot()
    plan = plan_reconcile(state, new)
    assert plan is not None and len(plan.removed) == 260
    assert plan.departed is None  # 260 linear searches would be quadratic
    where = {endpoint: i for i, endpoint in enumerate(state.order)}
    state.position_of = where.get
    hinted = plan_reconcile(state, new)
    assert hinted is not None and hinted.departed is not None
    assert sorted(map(str, hinted.departed)) == keys[:260] and hinted.in_place == 0
