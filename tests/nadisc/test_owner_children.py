"""Keyed child tasks of the owner: ``DiscoveryOwner.start_child``."""

from __future__ import annotations

import logging

import anyio
import pytest
import trio
import trio.testing
from anyio.abc import TaskStatus

from nadisc import LifecycleError, Provider, QualifierError
from nadisc.testing import MemoryProvider

from .owner_support import all_tasks, memory_owner

pytestmark = pytest.mark.trio_only


class Worker:
    """A child function that counts its starts and runs until cancelled."""

    def __init__(self, value: object = "ready") -> None:
        self.value = value
        self.starts = 0
        self.providers: list[Provider] = []
        self.running = 0
        self.release = trio.Event()

    async def __call__(self, provider: Provider, *, task_status: TaskStatus[object]) -> None:
        self.starts += 1
        self.providers.append(provider)
        await trio.sleep(1)  # a start that takes a while (callers overlap)
        self.running += 1
        try:
            task_status.started(self.value)
            await trio.sleep_forever()
        finally:
            self.running -= 1


async def test_one_start_per_connection_and_key(autojump_clock: trio.testing.MockClock) -> None:
    primary, other = MemoryProvider(services={}), MemoryProvider(services={})
    worker = Worker()
    before = all_tasks()
    async with memory_owner({"primary": primary, "other": other}) as owner:
        results: list[object] = []

        async def ask() -> None:
            results.append(await owner.start_child(None, "catalog", worker))

        async with anyio.create_task_group() as tg:  # concurrent callers share one start
            for _ in range(3):
                tg.start_soon(ask)
        assert results == ["ready"] * 3
        assert await owner.start_child("primary", "catalog", worker) == "ready"
        assert worker.starts == 1 and worker.providers == [primary]
        await owner.start_child("other", "catalog", worker)
        await owner.start_child("primary", "another", worker)
        assert worker.starts == 3 and worker.providers[1] is other
        assert worker.running == 3
        assert "tasks=3" in repr(owner)
    assert worker.running == 0
    report = owner.close_report
    assert report is not None and report.tasks_left == 0
    assert all_tasks() == before


async def test_refused_for_unknown_connections_and_after_quiesce(
    autojump_clock: trio.testing.MockClock,
) -> None:
    worker = Worker()
    async with memory_owner({"primary": MemoryProvider(services={})}) as owner:
        with pytest.raises(QualifierError, match="nope"):
            await owner.start_child("nope", "k", worker)
        owner.begin_quiesce(anyio.current_time() + 5)
        with pytest.raises(LifecycleError, match="quiescing"):
            await owner.start_child(None, "k", worker)
        await owner.begin_close(anyio.current_time() + 5).wait()
        with pytest.raises(LifecycleError, match="closed"):
            await owner.start_child(None, "k", worker)
    assert worker.starts == 0


async def test_failure_before_start_reaches_callers_and_frees_the_key(
    autojump_clock: trio.testing.MockClock,
) -> None:
    attempts: list[int] = []

    async def flaky(provider: Provider, *, task_status: TaskStatus[object]) -> None:
        attempts.append(1)
        await trio.sleep(1)
        if len(attempts) == 1:
            raise RuntimeError("cannot start")
        task_status.started(len(attempts))
        await trio.sleep_forever()

    async with memory_owner({"primary": MemoryProvider(services={})}) as owner:
        errors: list[BaseException] = []

        async def ask() -> None:
            try:
                await owner.start_child(None, "k", flaky)
            except (RuntimeError, LifecycleError) as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await trio.sleep(0.5)
            tg.start_soon(ask)
        kinds = sorted(type(e).__name__ for e in errors)
        assert kinds == ["LifecycleError", "RuntimeError"]
        waiter_error = next(e for e in errors if isinstance(e, LifecycleError))
        assert isinstance(waiter_error.__cause__, RuntimeError)
        assert await owner.start_child(None, "k", flaky) == 2  # the key is free again
        assert len(attempts) == 2


async def test_failure_after_start_is_logged_and_the_owner_keeps_running(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    runs: list[int] = []

    async def breaks_later(provider: Provider, *, task_status: TaskStatus[object]) -> None:
        runs.append(1)
        task_status.started(len(runs))
        await trio.sleep(5)
        raise RuntimeError("defect")

    with caplog.at_level(logging.ERROR, logger="nadisc._owner"):
        async with memory_owner({"primary": MemoryProvider(services={})}) as owner:
            assert await owner.start_child(None, "k", breaks_later) == 1
            await trio.sleep(10)
            assert owner.phase.value == "prepared"
            assert await owner.start_child(None, "k", breaks_later) == 2  # restarted on demand
    assert any("child 'k' failed" in r.getMessage() for r in caplog.records)
