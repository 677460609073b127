"""``changed()`` wakes only when what a reader sees changes."""

from __future__ import annotations

import anyio
import pytest

from nadisc import (
    DeadlineExceeded,
    EvidenceUnavailable,
    IdentityRevoked,
    IncompleteSnapshot,
    Observation,
)
from nadisc.testing import MemoryProvider

from .owner_support import inst, memory_owner


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
