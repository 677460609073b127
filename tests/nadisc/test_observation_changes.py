"""``async for state in observation.changes()``: latest-only, optional deadline."""

from __future__ import annotations

import anyio
import pytest

from nadisc import (
    DeadlineExceeded,
    EvidenceUnavailable,
    IdentityRevoked,
    ObservationSnapshot,
)
from nadisc.testing import MemoryProvider

from .owner_support import inst, memory_owner


def _provider() -> MemoryProvider:
    provider = MemoryProvider(services={"orders": "orders"}, watch=True)
    provider.set("orders", [inst("a")])
    return provider


def _ids(state: ObservationSnapshot | EvidenceUnavailable) -> object:
    if isinstance(state, EvidenceUnavailable):
        return state.reason
    return state.identities()


@pytest.mark.trio_only
async def test_the_iteration_yields_now_then_each_change_then_ends_at_close(
    autojump_clock: object,
) -> None:
    provider = MemoryProvider(services={"orders": "orders"})
    provider.set("orders", [inst("a")])
    seen: list[object] = []
    async with memory_owner({"primary": provider}) as owner:
        orders = await owner.client().observe("orders")  # no deadline
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                async for state in orders.changes():
                    seen.append(_ids(state))

            tg.start_soon(consume)
            await anyio.sleep(1)
            provider.set("orders", [inst("a"), inst("b", 2)])
            await anyio.sleep(100)  # a poll interval or more
            provider.fail("orders", IdentityRevoked("403"))
            await anyio.sleep(100)
            provider.fail("orders", None)
            provider.set("orders", [inst("c", 3)])
            await anyio.sleep(100)
            owner.begin_close(anyio.current_time() + 5)
    assert seen == [("a",), ("a", "b"), "revoked", ("c",), "closed"]


async def test_a_slow_consumer_sees_the_newest_state_and_no_backlog() -> None:
    provider = _provider()
    async with memory_owner({"primary": provider}) as owner:
        orders = await owner.client().observe("orders")
        changes = orders.changes()
        first = await changes.__anext__()
        assert _ids(first) == ("a",)
        for n in range(2, 12):  # ten listings while the consumer is busy
            provider.set("orders", [inst(f"i{n}", n)])
            await anyio.sleep(0.02)
        newest = await changes.__anext__()
        assert _ids(newest) == ("i11",)
        with anyio.move_on_after(0.2) as idle:
            await changes.__anext__()
        assert idle.cancelled_caught  # nothing older is queued behind it


@pytest.mark.trio_only
async def test_the_deadline_bounds_the_iteration(autojump_clock: object) -> None:
    provider = MemoryProvider(services={"orders": "orders"})
    provider.set("orders", [inst("a")])
    async with memory_owner({"primary": provider}) as owner:
        orders = await owner.client().observe("orders", anyio.current_time() + 1)
        started = anyio.current_time()
        states = []
        with pytest.raises(DeadlineExceeded):
            async for state in orders.changes(anyio.current_time() + 5):
                states.append(state)
        assert len(states) == 1
        assert anyio.current_time() - started == pytest.approx(5)
        with pytest.raises(DeadlineExceeded, match="NaN"):
            orders.changes(float("nan"))


@pytest.mark.trio_only
async def test_observe_without_deadline_is_bounded_by_the_callers_scope(
    autojump_clock: object,
) -> None:
    provider = MemoryProvider(services={"orders": "orders"}, latency=1.5)
    provider.set("orders", [inst("a")])
    async with memory_owner({"primary": provider}) as owner:
        with anyio.move_on_after(1) as scope:
            await owner.client().observe("orders")
        assert scope.cancelled_caught
        # The query goes on for everybody else; without a deadline one waits for it.
        orders = await owner.client().observe("orders")
        assert orders.snapshot().identities() == ("a",)
