"""The latest-only cell: newest value wins, per-subscriber cursors, end of stream."""

from __future__ import annotations

import logging

import anyio
import anyio.lowlevel
import pytest

from poise import LatestCell
from tests.support_checkpoints import count_yields


async def test_empty_cell_has_no_value_and_subscribe_waits_for_first_publish() -> None:
    cell: LatestCell[str] = LatestCell()
    assert cell.revision == 0 and not cell.has_value
    with pytest.raises(LookupError):
        cell.get()
    sub = cell.reader().subscribe()
    assert not sub.pending
    with pytest.raises(anyio.WouldBlock):
        sub.receive_nowait()
    got: list[str] = []

    async def receiver() -> None:
        got.append(await sub.receive())

    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver)
        await anyio.wait_all_tasks_blocked()
        assert got == []
        assert cell.publish("a") == 1
    assert got == ["a"] and sub.seen == 1


def test_initial_value_is_revision_one_and_at_most_one_initial_value() -> None:
    cell = LatestCell("x")
    assert cell.revision == 1 and cell.get() == "x"
    with pytest.raises(TypeError):
        LatestCell("a", "b")


async def test_a_burst_of_publishes_yields_only_the_newest() -> None:
    cell = LatestCell(0)
    sub = cell.reader().subscribe()
    assert await sub.receive() == 0
    for value in range(1, 50):
        cell.publish(value)
    assert sub.pending
    assert await sub.receive() == 49
    assert not sub.pending
    with pytest.raises(anyio.WouldBlock):
        sub.receive_nowait()


async def test_changes_starts_after_the_current_revision() -> None:
    cell = LatestCell("old")
    changes = cell.reader().changes()
    assert not changes.pending
    cell.publish("new")
    assert changes.receive_nowait() == "new"


async def test_two_subscribers_have_independent_cursors() -> None:
    cell = LatestCell("a")
    first = cell.reader().subscribe()
    second = cell.reader().subscribe()
    assert await first.receive() == "a"
    cell.publish("b")
    assert await first.receive() == "b"
    # The second reader never read "a"; it sees only the newest.
    assert await second.receive() == "b"
    cell.publish("c")
    assert second.receive_nowait() == "c"
    assert first.pending
    assert first.receive_nowait() == "c"


async def test_end_of_stream_after_the_final_revision() -> None:
    cell = LatestCell(1)
    sub = cell.reader().subscribe()
    cell.publish(2)
    cell.close()
    cell.close()  # idempotent
    assert cell.closed and not sub.ended
    assert await sub.receive() == 2
    assert sub.ended
    with pytest.raises(anyio.EndOfStream):
        await sub.receive()
    with pytest.raises(anyio.ClosedResourceError):
        cell.publish(3)
    values = [value async for value in cell.reader().subscribe()]
    assert values == [2]


async def test_close_wakes_a_waiting_receiver_with_end_of_stream() -> None:
    cell = LatestCell("only")
    sub = cell.reader().changes()
    outcome: list[str] = []

    async def receiver() -> None:
        try:
            await sub.receive()
        except anyio.EndOfStream:
            outcome.append("ended")

    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver)
        await anyio.wait_all_tasks_blocked()
        cell.close()
    assert outcome == ["ended"]


async def test_cancelling_a_waiting_subscriber_leaves_others_intact() -> None:
    cell = LatestCell(0)
    doomed = cell.reader().changes()
    survivor = cell.reader().changes()
    got: list[int] = []

    async def survive() -> None:
        got.append(await survivor.receive())

    scope = anyio.CancelScope()

    async def doomed_wait() -> None:
        with scope:
            await doomed.receive()

    async with anyio.create_task_group() as tg:
        tg.start_soon(survive)
        tg.start_soon(doomed_wait)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert scope.cancelled_caught
        cell.publish(7)
    assert got == [7]
    # The cancelled receiver kept its cursor: the value is still pending for it.
    assert doomed.seen == 1 and doomed.pending
    assert doomed.receive_nowait() == 7


async def test_receive_checkpoints_even_when_a_value_is_ready() -> None:
    cell = LatestCell("v")
    sub = cell.reader().subscribe()
    with anyio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(anyio.get_cancelled_exc_class()):
            await sub.receive()
    # Cancellation before taking the value does not advance the cursor.
    assert sub.pending and await sub.receive() == "v"


async def test_wait_does_not_consume() -> None:
    cell = LatestCell(1)
    sub = cell.reader().changes()

    async def later() -> None:
        await anyio.wait_all_tasks_blocked()
        cell.publish(2)

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        await sub.wait()
    assert sub.pending and sub.receive_nowait() == 2
    cell.close()
    await sub.wait()  # returns: the stream ended
    assert sub.ended


def test_wakers_are_one_shot_deduplicated_and_fire_on_publish_and_close() -> None:
    cell = LatestCell("a")
    calls: list[str] = []

    def wake() -> None:
        calls.append("wake")

    cell.add_waker(wake)
    cell.add_waker(wake)  # same callable: one registration
    cell.publish("b")
    assert calls == ["wake"]
    cell.publish("c")  # one-shot: not registered any more
    assert calls == ["wake"]
    cell.add_waker(wake)
    cell.discard_waker(wake)
    cell.publish("d")
    assert calls == ["wake"]
    cell.add_waker(wake)
    cell.close()
    assert calls == ["wake", "wake"]
    cell.add_waker(wake)  # closed: nothing will change, never called
    assert calls == ["wake", "wake"]


def test_subscription_waker_fires_at_once_when_a_value_is_pending() -> None:
    cell = LatestCell("a")
    sub = cell.reader().subscribe()
    calls: list[int] = []
    sub.add_waker(lambda: calls.append(1))
    assert calls == [1]
    sub.receive_nowait()
    sub.add_waker(lambda: calls.append(2))
    assert calls == [1]
    cell.publish("b")
    assert calls == [1, 2]


def test_a_raising_waker_does_not_fail_publish_or_starve_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cell = LatestCell(0)
    calls: list[str] = []

    def broken() -> None:
        raise RuntimeError("boom")

    cell.add_waker(broken)
    cell.add_waker(lambda: calls.append("other"))
    with caplog.at_level(logging.ERROR, logger="poise._cell"):
        assert cell.publish(1) == 2
    assert calls == ["other"] and cell.get() == 1
    assert "waker raised" in caplog.text


def test_reader_cannot_publish_and_reports_state() -> None:
    cell = LatestCell("a")
    reader = cell.reader()
    assert not hasattr(reader, "publish")
    assert reader.load() == "a" and reader.revision == 1 and not reader.closed
    cell.close()
    assert reader.closed
    assert "closed" in repr(cell)
    assert "seen=0" in repr(reader.subscribe())


async def test_a_waiting_receive_returns_as_soon_as_it_is_woken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait was the receive's checkpoint: once woken it returns without
    yielding to the loop again (a value reaches a waiting reader in the
    pass after the publish, not one later). A receive that finds a value
    still checkpoints (test above)."""
    cell: LatestCell[int] = LatestCell(0)
    sub = cell.reader().changes()
    got: list[int] = []
    receivers: set[int] = set()
    taken = count_yields(monkeypatch, receivers)

    async def receiver() -> None:
        receivers.add(anyio.get_current_task().id)
        got.append(await sub.receive())

    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver)
        await anyio.wait_all_tasks_blocked()
        cell.publish(1)
    assert got == [1]
    assert taken == []
    # Without a wait, the receive checkpoints.
    cell.publish(2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver)
    assert got == [1, 2]
    assert taken == ["cancel_shielded_checkpoint"]


async def test_wait_past_waits_for_a_newer_revision_or_the_close() -> None:
    cell = LatestCell(0)
    reader = cell.reader()
    seen = reader.revision
    cell.publish(1)
    await reader.wait_past(seen)  # already past: returns at once
    order: list[str] = []

    async def waiter() -> None:
        await reader.wait_past(reader.revision)
        order.append(f"woken at {cell.revision}")

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        order.append("publish")
        cell.publish(2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        order.append("close")
        cell.close()
    assert order == ["publish", "woken at 3", "close", "woken at 3"]
    assert cell.get() == 2  # nothing consumed or changed by the waits
