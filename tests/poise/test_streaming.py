"""StreamingDiscoveryBalance: reconcile on readiness, one wake-up, end policies."""

from __future__ import annotations

from collections.abc import Hashable
from itertools import pairwise

import anyio
import anyio.lowlevel
import pytest

from poise import (
    Backend,
    Directory,
    DiscoveryBalance,
    FactoryError,
    ForeignSnapshot,
    InFlight,
    InvalidInput,
    LatestCell,
    LoadTracker,
    ReadinessError,
    ReconcileError,
    RoundRobin,
    SelectionError,
    Snapshot,
    StreamClosed,
    StreamEndPolicy,
    StreamingConfig,
    StreamingDiscoveryBalance,
    StreamingError,
)

from .test_reconcile import AsyncRecordingFactory, FakeService, RecordingFactory


def build(
    directory: Directory,
    factory: RecordingFactory | None = None,
    *,
    config: StreamingConfig | None = None,
    end_policy: StreamEndPolicy = StreamEndPolicy.SERVE_LAST_GOOD,
) -> tuple[StreamingDiscoveryBalance[object, object], RecordingFactory]:
    factory = factory or RecordingFactory()
    discovery: DiscoveryBalance[object, object] = DiscoveryBalance(RoundRobin(), factory)
    streaming = StreamingDiscoveryBalance(directory.reader(), discovery, config, end_policy)
    return streaming, factory


async def test_first_ready_applies_the_current_snapshot() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    streaming, _factory = build(directory)
    assert len(streaming.discovery) == 0
    await streaming.ready()
    assert streaming.discovery.revision == 1 and streaming.applications == 1
    assert await streaming.call("x") == ("a", "x")
    assert await streaming.dispatch("y") == ("a", "y")
    assert streaming.last_report is not None and streaming.last_report.added == 1
    assert streaming.ready_nowait()
    assert "applications=1" in repr(streaming)


async def test_a_burst_of_publications_is_applied_once_newest_only() -> None:
    directory = Directory()
    streaming, factory = build(directory)
    for i in range(20):
        directory.upsert(f"m{i}", Backend(f"m{i}"))
    directory.remove("m0")
    await streaming.ready()
    assert streaming.applications == 1
    assert streaming.discovery.revision == directory.revision
    assert len(streaming.discovery) == 19 and factory.calls == 19
    # Nothing new: no application, just readiness.
    await streaming.dispatch("x")
    assert streaming.applications == 1


async def test_a_stream_from_changes_starts_after_the_current_revision() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    discovery: DiscoveryBalance[object, object] = DiscoveryBalance(
        RoundRobin(),
        RecordingFactory(),
    )
    discovery.sync(directory.reader())
    streaming = StreamingDiscoveryBalance(directory.reader().changes(), discovery)
    await streaming.ready()
    assert streaming.applications == 0 and streaming.stream.pending is False
    directory.upsert("b", Backend("b"))
    await streaming.ready()
    assert streaming.applications == 1 and len(discovery) == 2


async def test_a_waiting_ready_is_woken_by_discovery() -> None:
    # Empty pool while the stream is open: ready() waits for a publication.
    directory = Directory()
    streaming, _factory = build(directory)
    done: list[int] = []

    async def waiter() -> None:
        await streaming.ready()
        done.append(streaming.discovery.revision)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert done == [] and streaming.applications == 1  # revision 0, empty
        directory.upsert("a", Backend("a"))
    assert done == [1]


async def test_one_wake_up_serves_endpoints_and_discovery() -> None:
    directory = Directory()
    directory.upsert("slow", Backend("slow"))
    streaming, factory = build(directory)
    await streaming.discovery.apply_snapshot_async(directory.snapshot())
    slow = factory.created[0]
    slow.ready = False
    woken_by: list[str] = []

    async def waiter(label: str) -> None:
        await streaming.ready()
        woken_by.append(label)

    # 1. The endpoint's own wake: the pending service becomes ready.
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, "service")
        await anyio.wait_all_tasks_blocked()
        assert woken_by == [] and slow.wakes
        slow.ready = True
        slow.wakes.pop()()
    assert woken_by == ["service"]
    await streaming.call("consume the reservation")

    # 2. Discovery: a new member that is ready at once, while "slow" still pends.
    slow.ready = False
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, "discovery")
        await anyio.wait_all_tasks_blocked()
        assert woken_by == ["service"]
        directory.upsert("fast", Backend("fast"))
    assert woken_by == ["service", "discovery"]
    assert [ep.key for ep in streaming.discovery.endpoints] == ["slow", "fast"]
    assert await streaming.call("x") == ("fast", "x")


async def test_budget_exhausted_yields_and_continues() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    republish = 5

    class Republishing(RecordingFactory):
        # Each build publishes again, as a busy control plane would.
        def _build(self, key: Hashable, backend: Backend) -> object:
            result = super()._build(key, backend)
            if self.calls <= republish:
                directory.upsert(f"k{self.calls}", Backend(f"k{self.calls}"))
            return result

    ticks = 0
    streaming, _factory = build(
        directory, Republishing(), config=StreamingConfig(max_applications_per_ready=1)
    )
    async with anyio.create_task_group() as tg:

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.lowlevel.checkpoint()

        tg.start_soon(ticker)
        await streaming.ready()
        tg.cancel_scope.cancel()
    assert streaming.discovery.revision == directory.revision
    assert streaming.applications == republish + 1
    assert ticks >= republish  # others ran between rounds


@pytest.mark.parametrize("budget", [1, 2, 3])
async def test_the_budget_bounds_applications_between_yields(
    budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    republish = 7

    class Republishing(RecordingFactory):
        # Each build publishes again, as a busy control plane would.
        def _build(self, key: Hashable, backend: Backend) -> object:
            result = super()._build(key, backend)
            if self.calls <= republish:
                directory.upsert(f"k{self.calls}", Backend(f"k{self.calls}"))
            return result

    streaming, _factory = build(
        directory, Republishing(), config=StreamingConfig(max_applications_per_ready=budget)
    )
    # Record how many snapshots were applied at every yield of ready(). (The
    # schedulers may run other tasks in either order within a batch, so a
    # second task could not count this exactly.)
    at_yield: list[int] = []
    checkpoint = anyio.lowlevel.checkpoint

    async def recording_checkpoint() -> None:
        at_yield.append(streaming.applications)
        await checkpoint()

    monkeypatch.setattr(anyio.lowlevel, "checkpoint", recording_checkpoint)
    await streaming.ready()
    at_yield.append(streaming.applications)
    assert streaming.applications == republish + 1
    assert streaming.discovery.revision == directory.revision
    steps = [later - earlier for earlier, later in pairwise(at_yield)]
    assert max(steps) == budget, at_yield  # a synchronous factory fills each round


def test_streaming_config_validates() -> None:
    assert StreamingConfig().max_applications_per_ready >= 1
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidInput, match="max_applications_per_ready"):
            StreamingConfig(max_applications_per_ready=bad)  # type: ignore[arg-type]


def test_constructor_validates() -> None:
    directory = Directory()
    discovery: DiscoveryBalance[object, object] = DiscoveryBalance(
        RoundRobin(),
        RecordingFactory(),
    )
    with pytest.raises(InvalidInput, match="source"):
        StreamingDiscoveryBalance(directory, discovery)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="discovery"):
        StreamingDiscoveryBalance(directory.reader(), "x")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="config"):
        StreamingDiscoveryBalance(directory.reader(), discovery, 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="end_policy"):
        StreamingDiscoveryBalance(directory.reader(), discovery, None, "x")  # type: ignore[arg-type]


# -- publisher closed ---------------------------------------------------------------------------


async def test_closed_publisher_serves_the_last_good_pool_by_default() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    streaming, _factory = build(directory)
    await streaming.ready()
    directory.upsert("b", Backend("b"))
    directory.close()
    assert not streaming.ended
    await streaming.ready()  # applies the final revision first
    assert streaming.ended and len(streaming.discovery) == 2
    assert await streaming.dispatch("x") in {("a", "x"), ("b", "x")}
    assert streaming.end_policy is StreamEndPolicy.SERVE_LAST_GOOD


async def test_closed_publisher_with_an_empty_pool_raises_instead_of_waiting() -> None:
    directory = Directory()
    directory.close()
    streaming, _factory = build(directory)
    with pytest.raises(SelectionError):
        await streaming.ready()


async def test_fail_closed_refuses_readiness_after_the_final_snapshot() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    streaming, _factory = build(directory, end_policy=StreamEndPolicy.FAIL_CLOSED)
    await streaming.ready()
    directory.upsert("b", Backend("b"))
    directory.close()
    with pytest.raises(StreamClosed, match="FAIL_CLOSED"):
        await streaming.ready()
    # The final snapshot was applied before refusing.
    assert streaming.discovery.revision == 2
    with pytest.raises(StreamClosed):
        await streaming.dispatch("x")


async def test_fail_closed_wakes_a_waiting_ready_when_the_publisher_closes() -> None:
    directory = Directory()
    streaming, _factory = build(directory, end_policy=StreamEndPolicy.FAIL_CLOSED)
    outcome: list[str] = []

    async def waiter() -> None:
        try:
            await streaming.ready()
        except StreamClosed:
            outcome.append("closed")

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        directory.close()
    assert outcome == ["closed"]


# -- reconcile failures ---------------------------------------------------------------------------


async def test_reconcile_failure_is_a_streaming_error_with_the_pool_intact() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    streaming, factory = build(directory)
    await streaming.ready()
    live = streaming.discovery.endpoints
    directory.upsert("b", Backend("b"))
    factory.fail_on = {factory.calls}
    with pytest.raises(StreamingError, match="revision 2") as info:
        await streaming.ready()
    assert isinstance(info.value.__cause__, FactoryError)
    assert streaming.failures == 1 and streaming.last_error is info.value.__cause__
    assert streaming.discovery.endpoints == live and streaming.discovery.revision == 1
    # The failed snapshot was observed: the next ready() serves the last good pool.
    await streaming.ready()
    assert await streaming.call("x") == ("a", "x")
    assert streaming.discovery.revision == 1
    # A newer publication is applied.
    directory.upsert("c", Backend("c"))
    await streaming.ready()
    assert streaming.discovery.revision == 3
    assert [ep.key for ep in streaming.discovery.endpoints] == ["a", "b", "c"]


async def test_a_foreign_stream_is_a_streaming_error() -> None:
    home, foreign = Directory(), Directory()
    home.upsert("a", Backend("a"))
    foreign.upsert("z", Backend("z"))
    discovery: DiscoveryBalance[object, object] = DiscoveryBalance(
        RoundRobin(),
        RecordingFactory(),
    )
    discovery.sync(home.reader())
    streaming = StreamingDiscoveryBalance(foreign.reader(), discovery)
    with pytest.raises(StreamingError) as info:
        await streaming.ready()
    assert isinstance(info.value.__cause__, ForeignSnapshot)
    await streaming.ready()  # last good pool
    assert [ep.key for ep in discovery.endpoints] == ["a"]


async def test_cancelled_application_is_retried_by_the_next_ready() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    gate = anyio.Event()

    class Gated(AsyncRecordingFactory):
        async def __call__(  # type: ignore[override]
            self, key: Hashable, backend: Backend
        ) -> tuple[FakeService, LoadTracker]:
            await gate.wait()
            return await super().__call__(key, backend)

    factory = Gated()
    streaming, _ = build(directory, factory)
    with anyio.move_on_after(5) as scope:

        async def cancel_when_blocked() -> None:
            await anyio.wait_all_tasks_blocked()
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_when_blocked)
            await streaming.ready()
    assert scope.cancelled_caught
    assert streaming.discovery.revision == -1 and not streaming.stream.pending
    gate.set()
    await streaming.ready()
    assert streaming.discovery.revision == 1 and streaming.applications == 1


async def test_async_factories_are_awaited_by_ready() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    streaming, factory = build(directory, AsyncRecordingFactory())
    assert await streaming.dispatch("x") == ("a", "x")
    assert factory.calls == 1


async def test_readiness_failure_of_the_whole_pool_propagates() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    streaming, factory = build(directory)
    await streaming.ready()
    await streaming.call("use the reservation")
    factory.created[0].fail = True
    with pytest.raises(ReadinessError, match="'a'") as info:
        await streaming.ready()
    assert "broken" in str(info.value.__cause__)


def test_in_flight_tracker_is_the_default_via_the_factory() -> None:
    directory = Directory()
    directory.upsert("a", Backend("a"))
    streaming, _factory = build(directory)
    streaming.discovery.sync(directory.reader())
    tracker = streaming.balance.endpoint("a").tracker
    assert isinstance(tracker.inner, InFlight)  # type: ignore[attr-defined]
    assert streaming.config.max_applications_per_ready == 4


async def test_a_latest_cell_of_snapshots_can_drive_the_balance() -> None:
    # Runtimes that publish complete snapshots into their own cell plug in too.
    directory = Directory()
    directory.upsert("a", Backend("a"))
    cell: LatestCell[Snapshot] = LatestCell(directory.snapshot())
    discovery: DiscoveryBalance[object, object] = DiscoveryBalance(RoundRobin(), RecordingFactory())
    streaming = StreamingDiscoveryBalance(cell.reader(), discovery)
    assert await streaming.dispatch("x") == ("a", "x")
    directory.upsert("b", Backend("b"))
    cell.publish(directory.snapshot())
    await streaming.ready()
    assert [ep.key for ep in discovery.endpoints] == ["a", "b"]
    assert streaming.stream.pending is False
    cell.publish("not a snapshot")  # type: ignore[arg-type]
    with pytest.raises(StreamingError, match="revision"):
        await streaming.ready()
    assert isinstance(streaming.last_error, ReconcileError)
    await streaming.ready()  # the last good pool serves on
    assert len(discovery) == 2
