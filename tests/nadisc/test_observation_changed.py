"""``changed()`` wakes only when what a reader sees changes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import pytest

from nadisc import (
    DeadlineExceeded,
    EvidenceKind,
    EvidenceUnavailable,
    IdentityRevoked,
    IncompleteSnapshot,
    Observation,
    ProviderSnapshot,
)
from nadisc._observation import Slot
from nadisc.testing import MemoryProvider
from tests.support_checkpoints import count_yields

from .owner_support import inst, memory_owner


@asynccontextmanager
async def observed_orders(provider: MemoryProvider) -> AsyncIterator[tuple[Observation, Slot]]:
    """``orders`` listed with one instance, observed through an owner: the
    observation and the slot behind it."""
    provider.set("orders", [inst("a")])
    async with memory_owner({"primary": provider}) as owner:
        handle = owner.client()
        orders = await handle.observe("orders", anyio.current_time() + 5)
        yield orders, handle._connection.slots["orders"]


def reasons(observation: Observation) -> tuple[str, str]:
    found = []
    for strict in (False, True):
        with pytest.raises(EvidenceUnavailable) as info:
            observation.snapshot(strict=strict)
        found.append(info.value.reason)
    return (found[0], found[1])


async def test_a_failure_behind_a_revocation_does_not_wake_changed(
    autojump_clock: object,
) -> None:
    provider = MemoryProvider(services={"orders": "orders"})
    provider.set("orders", [inst("a")])
    async with memory_owner({"primary": provider}) as owner:
        orders = await owner.client().observe("orders", anyio.current_time() + 5)
        provider.fail("orders", IdentityRevoked("403"))
        await orders.changed(anyio.current_time() + 10)
        assert reasons(orders) == ("revoked", "revoked")
        queries_before = provider.query_counts["orders"]
        # Now the registry is unreachable: both views stay "revoked", so a
        # waiter has nothing to wake up for.
        provider.fail("orders", IncompleteSnapshot("timeout"))
        with pytest.raises(DeadlineExceeded):
            await orders.changed(anyio.current_time() + 60)
        assert provider.query_counts["orders"] > queries_before + 1
        assert reasons(orders) == ("revoked", "revoked")
        # A complete listing lifts the revocation: that is a change.
        provider.fail("orders", None)
        provider.set("orders", [inst("b")])
        await orders.changed(anyio.current_time() + 60)
        assert orders.snapshot(strict=True).identities() == ("b",)


async def test_waiters_share_one_state_key_that_always_equals_the_evidence(
    autojump_clock: object,
) -> None:
    """Every observer woken by one outcome reads the slot's shared state key:
    worked out once, and equal to the evidence's own key at every time, on
    both sides of the expiry and after each event."""
    provider = MemoryProvider(services={"orders": "orders"})
    async with observed_orders(provider) as (orders, slot):
        evidence = slot.evidence

        def agree(start: float) -> None:
            times = [start + step for step in (0.0, 0.001, 1.0, 29.9, 30.0, 31.0, 600.0, 1e6)]
            keys = [slot.state_key(t) for t in times]
            assert keys == [evidence.state_key(t) for t in times]
            # Not stale at first, stale in the end: the expiry lies between.
            assert keys[0][1] is None and keys[-1][1] is not None

        now = anyio.current_time()
        first = slot.state_key(now)
        assert slot.state_key(now + 0.5) is first  # shared, not recomputed
        agree(now)
        provider.set("orders", [inst("b")])
        await orders.changed(anyio.current_time() + 60)
        assert slot.state_key(anyio.current_time()) != first  # a new generation
        agree(anyio.current_time())
        provider.fail("orders", IncompleteSnapshot("timeout"))
        await orders.changed(anyio.current_time() + 60)
        now = anyio.current_time()
        assert [slot.state_key(now + s) for s in (0.0, 1.0, 1e6)] == [
            evidence.state_key(now + s) for s in (0.0, 1.0, 1e6)
        ]


async def test_a_waiting_changed_returns_as_soon_as_it_is_woken(
    autojump_clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``changed()`` that waited returns as soon as it is woken: the wait
    was its checkpoint, so no further loop pass stands between a published
    listing and the waiter (before, two more did: one in the cell's
    receive, one in ``changed``). One that finds a change at once still
    checkpoints."""
    provider = MemoryProvider(services={"orders": "orders"})
    async with observed_orders(provider) as (orders, slot):
        waiters: set[int] = set()
        taken = count_yields(monkeypatch, waiters)

        async def waiter() -> None:
            waiters.add(anyio.get_current_task().id)
            await orders.changed(anyio.current_time() + 60)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            slot.publish(ProviderSnapshot("orders", (inst("b"),), EvidenceKind.REGISTRY_HEALTH))
        assert taken == []
        assert orders.snapshot().identities() == ("b",)
        # A change already there: returned after one checkpoint.
        slot.publish(ProviderSnapshot("orders", (inst("c"),), EvidenceKind.REGISTRY_HEALTH))
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
        assert taken == ["checkpoint"]
