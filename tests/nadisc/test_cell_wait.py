"""The loop-bound wait a handle's ``changed()`` uses (``run_cell_wait``)."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from nadisc._observation import run_cell_wait
from poise import LatestCell


def wakers(cell: LatestCell[int]) -> int:
    return len(cell._wakers)


async def test_a_publish_ends_the_wait_and_leaves_nothing_registered() -> None:
    cell = LatestCell(0)
    reader = cell.reader()
    wait = run_cell_wait()
    done: list[int] = []

    async def waiter() -> None:
        await wait(reader, reader.revision, anyio.current_time() + 60)
        done.append(cell.get())

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert done == []
        cell.publish(7)
    assert done == [7]
    assert wakers(cell) == 0


async def test_close_ends_the_wait() -> None:
    cell = LatestCell(0)
    reader = cell.reader()
    wait = run_cell_wait()
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, reader, reader.revision, anyio.current_time() + 60)
        await anyio.wait_all_tasks_blocked()
        cell.close()
    assert wakers(cell) == 0


async def test_the_time_limit_ends_the_wait() -> None:
    cell = LatestCell(0)
    reader = cell.reader()
    wait = run_cell_wait()
    with anyio.fail_after(30):  # a bound for a broken timer, not a measurement
        await wait(reader, reader.revision, anyio.current_time() + 0.01)
    assert cell.revision == 1  # nothing was published: the time ran out
    assert wakers(cell) == 0


async def test_a_cell_already_past_or_closed_returns_at_once() -> None:
    cell = LatestCell(0)
    reader = cell.reader()
    wait = run_cell_wait()
    seen = reader.revision
    cell.publish(1)
    with anyio.fail_after(30):
        await wait(reader, seen, anyio.current_time() + 3600)
        cell.close()
        await wait(reader, reader.revision, anyio.current_time() + 3600)
    assert wakers(cell) == 0


@pytest.mark.parametrize("limit", [60.0, float("inf")])
async def test_a_cancelled_wait_leaves_no_waker_and_the_cell_unharmed(limit: float) -> None:
    cell = LatestCell(0)
    reader = cell.reader()
    wait = run_cell_wait()
    with anyio.CancelScope() as scope:

        async def cancel_soon() -> None:
            await anyio.wait_all_tasks_blocked()
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_soon)
            await wait(reader, reader.revision, anyio.current_time() + limit)
    assert scope.cancelled_caught
    assert wakers(cell) == 0
    cell.publish(2)  # nobody left to wake
    assert cell.get() == 2
    # The same reader waits again, undisturbed.
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, reader, reader.revision, anyio.current_time() + 60)
        await anyio.wait_all_tasks_blocked()
        cell.publish(3)
    assert wakers(cell) == 0
