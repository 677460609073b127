"""DiscoveryBalance: transactional application of directory snapshots."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Hashable

import anyio
import anyio.lowlevel
import pytest

from poise import (
    Backend,
    Directory,
    DiscoveryBalance,
    DuplicateIdentity,
    Endpoint,
    FactoryError,
    ForeignSnapshot,
    GenerationTracker,
    InFlight,
    LoadTracker,
    ReadinessState,
    ReconcileError,
    ReconcileReport,
    RoundRobin,
    SelectionError,
    Snapshot,
    StaleRevision,
    UseRequest,
    in_flight_factory,
    service_fn,
)
from poise._reconcile import AppliedState, plan_reconcile

# -- test doubles (also used by the state machine) ------------------------------------------------


class FakeService:
    """A service whose readiness the test controls, that records close() and calls.

    ``ready`` decides poll_ready (True reserves one slot); ``fail`` makes
    poll_ready raise. ``gate`` (if set) holds every call open until it is set.
    """

    def __init__(self, key: Hashable, backend: Backend, generation: int) -> None:
        self.key = key
        self.backend = backend
        self.generation = generation
        self.ready = True
        self.fail = False
        self.reserved = 0
        self.released = 0
        self.closed = 0
        self.calls = 0
        self.gate: anyio.Event | None = None
        self.wakes: list[Callable[[], None]] = []

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        if self.fail:
            raise RuntimeError(f"{self.key} is broken")
        if self.ready:
            self.reserved += 1
            return True
        self.wakes.append(wake)
        return False

    def release_reservation(self) -> None:
        self.reserved -= 1
        self.released += 1

    async def call(self, request: object) -> tuple[Hashable, object]:
        self.reserved -= 1
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        return self.key, request

    def close(self) -> None:
        self.closed += 1

    def __repr__(self) -> str:
        return f"<FakeService {self.key!r} g{self.generation} closed={self.closed}>"


class FactoryFailure(Exception):
    """Raised by a recording factory told to fail."""


class RecordingFactory:
    """``factory(key, backend) -> (FakeService, InFlight)`` that remembers what it built.

    ``fail_on`` is a set of call numbers (0-based, counted over the factory's
    life) that raise :class:`FactoryFailure`; ``wrong_shape_on`` call numbers
    return a bare service instead of a pair.
    """

    def __init__(self) -> None:
        self.created: list[FakeService] = []
        self.calls = 0
        self.fail_on: set[int] = set()
        self.wrong_shape_on: set[int] = set()

    def _build(self, key: Hashable, backend: Backend) -> object:
        number = self.calls
        self.calls += 1
        if number in self.fail_on:
            raise FactoryFailure(f"factory call {number} for {key!r} failed")
        service = FakeService(key, backend, number)
        self.created.append(service)
        if number in self.wrong_shape_on:
            return service
        return service, InFlight()

    def __call__(self, key: Hashable, backend: Backend) -> tuple[FakeService, LoadTracker]:
        return self._build(key, backend)  # type: ignore[return-value]

    def leaked(self, live: set[int]) -> list[FakeService]:
        """Created services that are neither live (by id) nor closed exactly once."""
        return [
            s
            for s in self.created
            if (id(s) in live and s.closed != 0) or (id(s) not in live and s.closed != 1)
        ]


class AsyncRecordingFactory(RecordingFactory):
    """The same, as an ``async def`` factory that checkpoints before building."""

    async def __call__(  # type: ignore[override]
        self, key: Hashable, backend: Backend
    ) -> tuple[FakeService, LoadTracker]:
        await anyio.lowlevel.checkpoint()
        return self._build(key, backend)  # type: ignore[return-value]


def make(
    factory: Callable[..., object] | None = None,
) -> tuple[Directory, DiscoveryBalance[object, object], RecordingFactory]:
    recording = RecordingFactory()
    balance: DiscoveryBalance[object, object] = DiscoveryBalance(
        RoundRobin(),
        factory or recording,  # type: ignore[arg-type]
    )
    return Directory(), balance, recording


def fingerprint(balance: DiscoveryBalance[object, object]) -> list[tuple[object, ...]]:
    """Everything a failed application must leave exactly as it was."""
    return [
        (
            ep,
            ep.key,
            ep.service,
            ep.state,
            ep.eligible,
            ep.load(0.0),
            getattr(ep.service, "reserved", None),
        )
        for ep in balance.endpoints
    ] + [("revision", balance.revision, balance.draining)]


def state_of(endpoint: Endpoint[object, object]) -> ReadinessState:
    return endpoint.state


def services(balance: DiscoveryBalance[object, object]) -> list[FakeService]:
    return [ep.service for ep in balance.endpoints]  # type: ignore[misc]


# -- the seed's example ---------------------------------------------------------------------------


async def test_seed_example_apply_one_upsert() -> None:
    async def send(address: str, request: object) -> str:
        return f"{address} <- {request}"

    directory = Directory()
    directory.upsert("west", Backend("http://west"))

    # A real factory would construct a protocol client from this value.
    factory = in_flight_factory(
        lambda _key, backend: service_fn(functools.partial(send, backend.id))
    )
    balance = DiscoveryBalance(RoundRobin(), factory)
    report = balance.apply_snapshot(directory.snapshot())
    assert report.added == 1
    assert await balance.balance.dispatch("ping") == "http://west <- ping"
    assert isinstance(balance.endpoint("west").tracker, GenerationTracker)
    assert isinstance(balance.endpoint("west").tracker.inner, InFlight)  # type: ignore[attr-defined]


# -- classification -------------------------------------------------------------------------------


def test_report_counts_and_snapshot_order() -> None:
    directory, balance, factory = make()
    for key in ("a", "b", "c"):
        directory.upsert(key, Backend(key))
    first = balance.apply_snapshot(directory.snapshot())
    assert first == ReconcileReport(
        revision=3, retained=0, added=3, rebuilt=0, removed=0, draining=0
    )
    directory.upsert("b", Backend("b"))  # equal value, new allocation: rebuilt
    directory.remove("a")
    directory.upsert("d", Backend("d"))
    directory.drain("c")
    report = balance.apply_snapshot(directory.snapshot())
    assert (report.retained, report.added, report.rebuilt, report.removed, report.draining) == (
        1,
        1,
        1,
        1,
        1,
    )
    assert report.applied and report.revision == directory.revision
    assert [ep.key for ep in balance.endpoints] == ["b", "c", "d"]
    assert len(factory.created) == 5


def test_retained_endpoints_keep_the_whole_object_and_its_state() -> None:
    directory, balance, _factory = make()
    for key in ("ready", "failed", "loaded"):
        directory.upsert(key, Backend(key))
    balance.apply_snapshot(directory.snapshot())
    inner = balance.balance
    by_key = {ep.key: ep for ep in balance.endpoints}
    by_key["failed"].service.fail = True  # type: ignore[attr-defined]
    by_key["loaded"].service.ready = False  # type: ignore[attr-defined]
    assert inner.ready_nowait()
    guard = by_key["loaded"].tracker.start(0.0)  # a call in flight
    assert by_key["ready"].state is ReadinessState.READY
    assert by_key["failed"].state is ReadinessState.FAILED

    directory.upsert("new", Backend("new"))
    report = balance.apply_snapshot(directory.snapshot())
    assert report.retained == 3 and report.added == 1
    for name, ep in by_key.items():
        assert balance.endpoint(name) is ep
    assert by_key["ready"].state is ReadinessState.READY
    assert by_key["ready"].service.reserved == 1  # type: ignore[attr-defined]
    assert by_key["failed"].state is ReadinessState.FAILED
    assert by_key["loaded"].load(0.0) == 1
    assert balance.endpoint("new").state is ReadinessState.IDLE
    guard.complete(0.0)


async def test_rebuilt_generation_replaces_the_endpoint_and_closes_the_old_service() -> None:
    directory, balance, factory = make()
    directory.upsert("a", Backend("a"))
    balance.apply_snapshot(directory.snapshot())
    old = balance.endpoint("a")
    directory.upsert("a", Backend("a"))
    report = balance.apply_snapshot(directory.snapshot())
    assert report.rebuilt == 1 and report.retained == 0
    new = balance.endpoint("a")
    assert new is not old and new.service is not old.service
    assert new.tracker is not old.tracker
    assert factory.created[0].closed == 1 and factory.created[1].closed == 0
    assert old.index is None  # detached


def test_weight_and_metadata_come_from_the_backend() -> None:
    directory, balance, _factory = make()
    backend = Backend("a", weight=2.5, metadata={"zone": "x"})
    directory.upsert("a", backend)
    balance.apply_snapshot(directory.snapshot())
    ep = balance.endpoint("a")
    assert ep.weight == 2.5 and ep.metadata is backend


# -- draining and retirement ----------------------------------------------------------------------


async def test_drain_makes_the_endpoint_ineligible_at_once_and_keeps_it() -> None:
    directory, balance, _factory = make()
    directory.upsert("a", Backend("a"))
    directory.upsert("b", Backend("b"))
    balance.apply_snapshot(directory.snapshot())
    assert balance.balance.ready_nowait()
    a = balance.endpoint("a")
    assert a.state is ReadinessState.READY
    directory.drain("a")
    report = balance.apply_snapshot(directory.snapshot())
    assert report.draining == 1 and report.retained == 2
    assert balance.endpoint("a") is a and not a.eligible
    assert state_of(a) is ReadinessState.IDLE
    assert a.service.reserved == 0  # type: ignore[attr-defined]
    for _ in range(4):
        response = await balance.balance.dispatch("x")
        assert response == ("b", "x")


async def test_in_flight_calls_complete_normally_after_removal() -> None:
    directory, balance, factory = make()
    directory.upsert("a", Backend("a"))
    balance.apply_snapshot(directory.snapshot())
    service = factory.created[0]
    service.gate = anyio.Event()
    results: list[object] = []

    async def call() -> None:
        results.append(await balance.balance.dispatch("req"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        endpoint = balance.endpoint("a")
        assert endpoint.load(0.0) == 1
        directory.drain("a")
        balance.apply_snapshot(directory.snapshot())
        directory.finish_drain("a")
        report = balance.apply_snapshot(directory.snapshot())
        assert report.removed == 1 and len(balance) == 0
        # Retired but busy: not closed while its call is in flight.
        assert service.closed == 0
        assert isinstance(endpoint.tracker, GenerationTracker)
        assert endpoint.tracker.retired and endpoint.tracker.open_guards == 1
        service.gate.set()
    assert results == [("a", "req")]
    assert endpoint.load(0.0) == 0
    assert service.closed == 1


def test_a_member_added_while_draining_enters_ineligible() -> None:
    directory, balance, _factory = make()
    directory.upsert("a", Backend("a"))
    directory.drain("a")
    report = balance.apply_snapshot(directory.snapshot())
    assert report.added == 1 and report.draining == 1
    assert not balance.endpoint("a").eligible


def test_undrain_by_upsert_rebuilds_an_eligible_generation() -> None:
    directory, balance, _factory = make()
    directory.upsert("a", Backend("a"))
    directory.drain("a")
    balance.apply_snapshot(directory.snapshot())
    directory.upsert("a", Backend("a"))
    report = balance.apply_snapshot(directory.snapshot())
    assert report.rebuilt == 1 and report.draining == 0
    assert balance.endpoint("a").eligible


# -- revisions, lineage, validation ---------------------------------------------------------------


def test_equal_revision_is_a_no_op() -> None:
    directory, balance, factory = make()
    directory.upsert("a", Backend("a"))
    snapshot = directory.snapshot()
    balance.apply_snapshot(snapshot)
    before = fingerprint(balance)
    calls = factory.calls
    report = balance.apply_snapshot(snapshot)
    assert not report.applied and report.retained == 1 and report.added == 0
    assert report.revision == snapshot.revision
    assert fingerprint(balance) == before and factory.calls == calls


def test_older_revision_is_stale_and_changes_nothing() -> None:
    directory, balance, _factory = make()
    directory.upsert("a", Backend("a"))
    old = directory.snapshot()
    directory.upsert("b", Backend("b"))
    balance.apply_snapshot(directory.snapshot())
    before = fingerprint(balance)
    with pytest.raises(StaleRevision) as info:
        balance.apply_snapshot(old)
    assert info.value.revision == 1 and info.value.applied == 2
    assert fingerprint(balance) == before


def test_foreign_lineage_is_refused() -> None:
    directory, balance, _factory = make()
    directory.upsert("a", Backend("a"))
    balance.apply_snapshot(directory.snapshot())
    other = Directory()
    for key in ("a", "b", "c"):
        other.upsert(key, Backend(key))
    before = fingerprint(balance)
    with pytest.raises(ForeignSnapshot, match="Lineage"):
        balance.apply_snapshot(other.snapshot())
    assert fingerprint(balance) == before


def test_duplicate_keys_never_reach_the_balance() -> None:
    directory, balance, _factory = make()
    directory.upsert("a", Backend("a"))
    member = directory.snapshot().get("a")
    assert member is not None
    with pytest.raises(DuplicateIdentity) as info:
        Snapshot([member, member], revision=9, lineage=directory.lineage)
    assert isinstance(info.value, ReconcileError)
    assert len(balance) == 0 and balance.revision == -1


def test_not_a_snapshot_is_refused() -> None:
    _directory, balance, _factory = make()
    with pytest.raises(ReconcileError, match="Snapshot"):
        balance.apply_snapshot("revision 3")  # type: ignore[arg-type]


def test_membership_edited_behind_the_reconciler_is_detected() -> None:
    directory, balance, _factory = make()
    directory.upsert("a", Backend("a"))
    balance.apply_snapshot(directory.snapshot())
    balance.balance.push(Endpoint("intruder", FakeService("i", Backend("i"), -1)))
    directory.upsert("b", Backend("b"))
    with pytest.raises(ReconcileError, match="through snapshots"):
        balance.apply_snapshot(directory.snapshot())
    assert balance.revision == 1


def test_a_substitution_behind_the_reconciler_is_detected() -> None:
    # Same number of endpoints, different identities: a count would not tell.
    directory, balance, factory = make()
    for key in ("a", "b"):
        directory.upsert(key, Backend(key))
    balance.apply_snapshot(directory.snapshot())
    detached = balance.balance.remove("a")
    intruder: Endpoint[object, object] = Endpoint("intruder", FakeService("i", Backend("i"), -1))
    balance.balance.push(intruder)
    directory.upsert("c", Backend("c"))
    calls = factory.calls
    with pytest.raises(ReconcileError, match="edited outside"):
        balance.apply_snapshot(directory.snapshot())
    assert factory.calls == calls  # refused before staging anything
    assert balance.revision == 2
    assert [ep.key for ep in balance.endpoints] == ["b", "intruder"]
    assert detached.index is None and intruder.index == 1


# -- factory failures -----------------------------------------------------------------------------


@pytest.mark.parametrize("failing_call", [0, 1, 2])
def test_factory_failure_at_any_position_rolls_back(failing_call: int) -> None:
    directory, balance, factory = make()
    for key in ("a", "b"):
        directory.upsert(key, Backend(key))
    balance.apply_snapshot(directory.snapshot())
    assert balance.balance.ready_nowait()
    before = fingerprint(balance)
    directory.upsert("b", Backend("b2"))  # rebuilt
    directory.upsert("c", Backend("c"))  # added
    directory.upsert("d", Backend("d"))  # added
    directory.drain("a")  # retained, would flip
    factory.fail_on = {factory.calls + failing_call}
    with pytest.raises(FactoryError) as info:
        balance.apply_snapshot(directory.snapshot())
    assert isinstance(info.value.__cause__, FactoryFailure)
    assert info.value.key == ("b", "c", "d")[failing_call]
    assert fingerprint(balance) == before
    assert balance.endpoint("a").eligible
    staged = factory.created[2:]
    assert len(staged) == failing_call and all(s.closed == 1 for s in staged)
    # The same snapshot applies once the factory recovers.
    factory.fail_on = set()
    report = balance.apply_snapshot(directory.snapshot())
    assert (report.rebuilt, report.added, report.draining) == (1, 2, 1)


@pytest.mark.parametrize(
    "result",
    [
        "a string",
        (FakeService("x", Backend("x"), -1),),
        ("not a service", InFlight()),
        (FakeService("x", Backend("x"), -1), "not a tracker"),
        [FakeService("x", Backend("x"), -1), InFlight()],
    ],
    ids=["not-a-tuple", "one-element", "bad-service", "bad-tracker", "list"],
)
def test_wrong_shaped_factory_result_is_a_factory_error(result: object) -> None:
    directory = Directory()
    directory.upsert("ok", Backend("ok"))
    directory.upsert("bad", Backend("bad"))
    good: list[FakeService] = []

    def factory(key: Hashable, backend: Backend) -> object:
        if key == "bad":
            return result
        service = FakeService(key, backend, 0)
        good.append(service)
        return service, InFlight()

    balance: DiscoveryBalance[object, object] = DiscoveryBalance(
        RoundRobin(),
        factory,  # type: ignore[arg-type]
    )
    with pytest.raises(FactoryError, match="'bad'") as info:
        balance.apply_snapshot(directory.snapshot())
    assert info.value.key == "bad"
    assert len(balance) == 0 and balance.revision == -1
    assert [s.closed for s in good] == [1]
    # A service inside a discarded result is closed too: nothing leaks.
    items = result if isinstance(result, tuple | list) else ()
    inside = [item for item in items if isinstance(item, FakeService)]
    assert all(item.closed == 1 for item in inside)


def test_in_flight_factory_wraps_a_service_only_callable() -> None:
    built: list[FakeService] = []

    def make_service(key: Hashable, backend: Backend) -> FakeService:
        service = FakeService(key, backend, len(built))
        built.append(service)
        return service

    factory = in_flight_factory(make_service)
    first = factory("a", Backend("a"))
    second = factory("a", Backend("a"))
    assert isinstance(first, tuple)
    assert isinstance(second, tuple)
    assert first[0] is built[0] and isinstance(first[1], InFlight)
    assert first[1] is not second[1]  # a fresh tracker per generation
    with pytest.raises(TypeError):
        in_flight_factory("nope")  # type: ignore[call-overload]


def test_sync_apply_refuses_an_async_factory_before_calling_it() -> None:
    factory = AsyncRecordingFactory()
    directory = Directory()
    directory.upsert("a", Backend("a"))
    balance: DiscoveryBalance[object, object] = DiscoveryBalance(RoundRobin(), factory)
    with pytest.raises(FactoryError, match="apply_snapshot_async"):
        balance.apply_snapshot(directory.snapshot())
    assert factory.calls == 0 and len(balance) == 0


def test_sync_apply_of_a_hidden_async_factory_closes_the_coroutine() -> None:
    inner = AsyncRecordingFactory()
    directory = Directory()
    directory.upsert("a", Backend("a"))

    def hidden(key: Hashable, backend: Backend) -> object:
        return inner(key, backend)

    balance: DiscoveryBalance[object, object] = DiscoveryBalance(RoundRobin(), hidden)  # type: ignore[arg-type]
    with pytest.raises(FactoryError, match="awaitable"):
        balance.apply_snapshot(directory.snapshot())
    gc.collect()  # an unclosed coroutine would warn here (warnings are errors)
    assert len(balance) == 0


def test_an_async_factory_may_still_apply_drains_and_removals_synchronously() -> None:
    directory = Directory()
    balance: DiscoveryBalance[object, object] = DiscoveryBalance(
        RoundRobin(),
        AsyncRecordingFactory(),
    )
    report = balance.apply_snapshot(directory.snapshot())  # nothing to stage
    assert report.revision == 0 and report.applied


# -- async application ----------------------------------------------------------------------------


async def test_apply_snapshot_async_with_an_async_factory() -> None:
    factory = AsyncRecordingFactory()
    directory = Directory()
    for key in ("a", "b"):
        directory.upsert(key, Backend(key))
    balance: DiscoveryBalance[object, object] = DiscoveryBalance(RoundRobin(), factory)
    report = await balance.apply_snapshot_async(directory.snapshot())
    assert report.added == 2
    assert await balance.balance.dispatch(1) == ("a", 1)
    # Equal revision: no-op, still a checkpoint.
    assert not (await balance.apply_snapshot_async(directory.snapshot())).applied


async def test_apply_snapshot_async_accepts_sync_factories_too() -> None:
    directory, balance, factory = make()
    directory.upsert("a", Backend("a"))
    report = await balance.apply_snapshot_async(directory.snapshot())
    assert report.added == 1 and factory.calls == 1
    directory.remove("a")
    report = await balance.apply_snapshot_async(directory.snapshot())
    assert report.removed == 1 and factory.created[0].closed == 1


async def test_async_factory_failure_at_any_position_rolls_back() -> None:
    # (A loop, not parametrize: the asyncio pass cannot parametrize async tests.)
    for failing_call in (0, 1, 2):
        factory = AsyncRecordingFactory()
        directory = Directory()
        directory.upsert("a", Backend("a"))
        balance: DiscoveryBalance[object, object] = DiscoveryBalance(RoundRobin(), factory)
        await balance.apply_snapshot_async(directory.snapshot())
        before = fingerprint(balance)
        for key in ("b", "c", "d"):
            directory.upsert(key, Backend(key))
        factory.fail_on = {factory.calls + failing_call}
        with pytest.raises(FactoryError) as info:
            await balance.apply_snapshot_async(directory.snapshot())
        assert isinstance(info.value.__cause__, FactoryFailure)
        assert info.value.key == ("b", "c", "d")[failing_call]
        assert fingerprint(balance) == before
        assert len(factory.created) == 1 + failing_call
        assert all(s.closed == 1 for s in factory.created[1:])


async def test_cancelled_async_staging_commits_nothing_and_closes_staged() -> None:
    gate = anyio.Event()
    created: list[FakeService] = []

    async def slow_factory(key: Hashable, backend: Backend) -> tuple[FakeService, LoadTracker]:
        if key == "c":
            await gate.wait()
        service = FakeService(key, backend, len(created))
        created.append(service)
        return service, InFlight()

    directory = Directory()
    directory.upsert("a", Backend("a"))
    balance: DiscoveryBalance[object, object] = DiscoveryBalance(RoundRobin(), slow_factory)
    await balance.apply_snapshot_async(directory.snapshot())
    before = fingerprint(balance)
    directory.upsert("b", Backend("b"))
    directory.upsert("c", Backend("c"))
    with anyio.move_on_after(5) as scope:

        async def cancel_when_blocked() -> None:
            await anyio.wait_all_tasks_blocked()
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_when_blocked)
            await balance.apply_snapshot_async(directory.snapshot())
    assert scope.cancelled_caught
    assert fingerprint(balance) == before
    assert [s.key for s in created] == ["a", "b"] and created[1].closed == 1
    # Nothing is left half-done: the next application succeeds.
    gate.set()
    report = await balance.apply_snapshot_async(directory.snapshot())
    assert report.added == 2


async def test_concurrent_async_applications_run_one_after_the_other() -> None:
    gate = anyio.Event()

    async def factory(key: Hashable, backend: Backend) -> tuple[FakeService, LoadTracker]:
        await gate.wait()
        return FakeService(key, backend, 0), InFlight()

    directory = Directory()
    directory.upsert("a", Backend("a"))
    first = directory.snapshot()
    directory.upsert("b", Backend("b"))
    second = directory.snapshot()
    balance: DiscoveryBalance[object, object] = DiscoveryBalance(RoundRobin(), factory)
    reports: list[ReconcileReport] = []

    async def apply(snapshot: Snapshot) -> None:
        reports.append(await balance.apply_snapshot_async(snapshot))

    async with anyio.create_task_group() as tg:
        tg.start_soon(apply, first)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(apply, second)
        await anyio.wait_all_tasks_blocked()
        # A synchronous application while one is staging is refused.
        with pytest.raises(ReconcileError, match="staging"):
            balance.apply_snapshot(second)
        gate.set()
    assert [r.revision for r in reports] == [1, 2]
    assert (reports[1].retained, reports[1].added) == (1, 1)
    assert [ep.key for ep in balance.endpoints] == ["a", "b"]


async def test_close_during_async_staging_commits_nothing_and_closes_staged() -> None:
    gate = anyio.Event()
    created: list[FakeService] = []

    async def factory(key: Hashable, backend: Backend) -> tuple[FakeService, LoadTracker]:
        if key == "b":
            await gate.wait()
        service = FakeService(key, backend, len(created))
        created.append(service)
        return service, InFlight()

    directory = Directory()
    directory.upsert("a", Backend("a"))
    balance: DiscoveryBalance[object, object] = DiscoveryBalance(RoundRobin(), factory)
    await balance.apply_snapshot_async(directory.snapshot())
    directory.upsert("b", Backend("b"))
    directory.upsert("c", Backend("c"))
    errors: list[ReconcileError] = []

    async def apply() -> None:
        try:
            await balance.apply_snapshot_async(directory.snapshot())
        except ReconcileError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(apply)
        await anyio.wait_all_tasks_blocked()
        balance.close()
        assert created[0].closed == 1 and len(balance) == 0
        gate.set()
    assert len(errors) == 1 and "closed" in str(errors[0])
    # "b" was staged, never committed, and closed once; "c" was never built.
    assert [s.key for s in created] == ["a", "b"]
    assert [s.closed for s in created] == [1, 1]
    assert len(balance) == 0 and balance.revision == 1 and balance.closed
    with pytest.raises(SelectionError):
        await balance.balance.dispatch("x")
    assert created[1].calls == 0


async def test_a_membership_edit_during_async_staging_is_refused_at_commit() -> None:
    gate = anyio.Event()
    created: list[FakeService] = []

    async def factory(key: Hashable, backend: Backend) -> tuple[FakeService, LoadTracker]:
        if key == "c":
            await gate.wait()
        service = FakeService(key, backend, len(created))
        created.append(service)
        return service, InFlight()

    directory = Directory()
    for key in ("a", "b"):
        directory.upsert(key, Backend(key))
    balance: DiscoveryBalance[object, object] = DiscoveryBalance(RoundRobin(), factory)
    await balance.apply_snapshot_async(directory.snapshot())
    directory.upsert("c", Backend("c"))
    errors: list[ReconcileError] = []

    async def apply() -> None:
        try:
            await balance.apply_snapshot_async(directory.snapshot())
        except ReconcileError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(apply)
        await anyio.wait_all_tasks_blocked()
        balance.balance.remove("a")
        gate.set()
    assert len(errors) == 1 and "edited outside" in str(errors[0])
    assert [s.key for s in created] == ["a", "b", "c"]
    assert created[2].closed == 1  # the staged "c" was discarded
    assert [ep.key for ep in balance.endpoints] == ["b"] and balance.revision == 2


# -- sync(), close(), balance options -------------------------------------------------------------


def test_sync_is_one_load_and_apply() -> None:
    directory, balance, _factory = make()
    reader = directory.reader()
    directory.upsert("a", Backend("a"))
    assert balance.sync(reader).added == 1
    assert not balance.sync(reader).applied
    directory.upsert("b", Backend("b"))
    assert balance.sync(reader).added == 1 and balance.revision == 2


async def test_close_closes_every_service_once_its_calls_end() -> None:
    directory, balance, factory = make()
    for key in ("a", "b"):
        directory.upsert(key, Backend(key))
    balance.apply_snapshot(directory.snapshot())
    guard = balance.endpoint("a").tracker.start(0.0)
    balance.close()
    balance.close()
    assert balance.closed and len(balance) == 0
    assert [s.closed for s in factory.created] == [0, 1]
    guard.complete(0.0)
    assert [s.closed for s in factory.created] == [1, 1]
    with pytest.raises(ReconcileError, match="closed"):
        balance.apply_snapshot(directory.snapshot())


async def test_balance_options_pass_through() -> None:
    seen: list[object] = []

    class Recording(RoundRobin):
        def pick(self, ready, context, now):
            seen.append((context, now))
            return super().pick(ready, context, now)

    directory = Directory()
    directory.upsert("a", Backend("a"))
    balance: DiscoveryBalance[object, object] = DiscoveryBalance(
        Recording(),
        RecordingFactory(),
        context=UseRequest(),
        clock=lambda: 42.0,
    )
    balance.apply_snapshot(directory.snapshot())
    await balance.balance.dispatch("affinity")
    assert seen == [("affinity", 42.0)]
    assert "revision=1" in repr(balance)


def test_a_balance_that_refuses_the_commit_leaves_everything_unchanged() -> None:
    # Applying from inside a readiness scan: the balance refuses the new list.
    directory, balance, factory = make()
    directory.upsert("a", Backend("a"))
    balance.apply_snapshot(directory.snapshot())
    directory.upsert("b", Backend("b"))
    snapshot = directory.snapshot()
    errors: list[BaseException] = []
    before: list[list[tuple[object, ...]]] = []

    class Reentrant(FakeService):
        def poll_ready(self, wake: Callable[[], None]) -> bool:
            before.append(fingerprint(balance))
            try:
                balance.apply_snapshot(snapshot)
            except ReconcileError as exc:
                errors.append(exc)
            return super().poll_ready(wake)

    live = balance.endpoint("a")
    live.service = Reentrant("a", Backend("a"), 99)
    assert balance.balance.ready_nowait()
    assert len(errors) == 1 and "refused" in str(errors[0])
    assert isinstance(errors[0].__cause__, RuntimeError)
    assert before[0][0][0] is live and len(balance) == 1 and balance.revision == 1
    assert factory.created[-1].key == "b" and factory.created[-1].closed == 1
    # Outside the scan the same snapshot applies.
    assert balance.apply_snapshot(snapshot).added == 1


def test_factory_not_callable_is_refused() -> None:
    with pytest.raises(TypeError, match="callable"):
        DiscoveryBalance(RoundRobin(), "factory")  # type: ignore[arg-type]


# -- the sans-IO planner --------------------------------------------------------------------------


def test_planner_over_plain_data() -> None:
    directory = Directory()
    for key in ("a", "b", "c", "d"):
        directory.upsert(key, Backend(key))
    first = directory.snapshot()
    state: AppliedState[str] = AppliedState(
        revision=first.revision,
        lineage=first.lineage,
        members=first.by_key,
        endpoints={key: f"ep-{key}" for key in first.by_key},
        order=[f"ep-{key}" for key in first.by_key],
    )
    directory.drain("a")
    directory.upsert("b", Backend("b"))
    directory.remove("c")
    directory.upsert("e", Backend("e"))
    plan = plan_reconcile(state, directory.snapshot())
    assert plan is not None
    assert plan.order == ["ep-a", None, "ep-d", None]
    assert [(pos, m.key) for pos, m in plan.build] == [(1, "b"), (3, "e")]
    assert plan.replaced == ["ep-b"]
    assert plan.removed == [("c", "ep-c")]
    assert [(ep, m.draining) for ep, m in plan.flips] == [("ep-a", True)]
    assert (plan.retained, plan.added, plan.rebuilt, plan.draining) == (2, 1, 1, 1)
    assert plan_reconcile(state, first) is None  # equal revision
    # The planner never mutates its input.
    assert state.endpoints == {key: f"ep-{key}" for key in "abcd"}


def test_planner_detects_inconsistent_live_identities() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    snapshot = directory.snapshot()
    state: AppliedState[str] = AppliedState(
        revision=0, lineage=snapshot.lineage, members=snapshot.by_key, endpoints={}
    )
    with pytest.raises(ReconcileError, match="inconsistent"):
        plan_reconcile(state, snapshot.__class__([], revision=5, lineage=snapshot.lineage))


# -- the documented examples run as written ------------------------------------------------------


def _doc_blocks() -> list[str]:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "discovery-balance.md").read_text()
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


def test_the_documented_seed_example_runs() -> None:
    namespace: dict[str, object] = {}
    exec(_doc_blocks()[0], namespace)
    report = namespace["report"]
    assert isinstance(report, ReconcileReport) and report.added == 1


async def test_the_documented_streaming_example_runs() -> None:
    namespace: dict[str, object] = {}
    exec(_doc_blocks()[0], namespace)
    import poise

    namespace.update(vars(poise))
    namespace["request"] = "ping"

    async def send(address: str, request: object) -> str:
        return f"{address} <- {request}"

    namespace["send"] = send
    body = "\n".join("    " + line for line in _doc_blocks()[1].splitlines())
    exec(f"async def _example():\n{body}\n    return response\n", namespace)
    example = namespace["_example"]
    assert await example() == "http://west <- ping"  # type: ignore[operator]


async def test_in_flight_factory_of_an_async_callable_is_an_async_factory() -> None:
    async def connect(key: Hashable, backend: Backend) -> FakeService:
        await anyio.lowlevel.checkpoint()
        return FakeService(key, backend, 0)

    factory = in_flight_factory(connect)
    directory = Directory()
    directory.upsert("a", Backend("a"))
    balance: DiscoveryBalance[object, object] = DiscoveryBalance(RoundRobin(), factory)
    with pytest.raises(FactoryError, match="async"):
        balance.apply_snapshot(directory.snapshot())
    report = await balance.apply_snapshot_async(directory.snapshot())
    assert report.added == 1
    tracker = balance.endpoint("a").tracker
    assert isinstance(tracker, GenerationTracker) and isinstance(tracker.inner, InFlight)
