"""MemoryRegistry on its own: the faults it injects behave as documented."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from nadisc import (
    DeadlineExceeded,
    HealthStatus,
    IdentityRevoked,
    IncompleteSnapshot,
    LeaseLost,
    OutcomeUnknown,
    RegistrationRecord,
)
from nadisc._memory_registry import Fault, MemoryRegistry
from nadisc.testing import MemoryProvider

pytestmark = pytest.mark.trio_only

RECORD = RegistrationRecord(
    registration="web", service="orders", instance_id="o-1", host="10.0.0.5", port=8080
)


def later() -> float:
    return trio.current_time() + 3.0


async def test_plain_lifecycle(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry()
    registered = await registry.register(RECORD, later())
    assert registered.record == RECORD and registered.handle
    assert await registry.check(registered, later()) is HealthStatus.HEALTHY
    assert await registry.renew(registered, later()) == registered
    assert registry.get("o-1").renewals == 1  # type: ignore[union-attr]
    await registry.deregister(registered, later())
    assert registry.instance_ids() == ()
    assert await registry.check(registered, later()) is HealthStatus.MISSING
    with pytest.raises(LeaseLost):
        await registry.renew(registered, later())
    assert [op for op, _ in registry.operations()] == [
        "register",
        "check",
        "renew",
        "deregister",
        "check",
        "renew",
    ]
    with pytest.raises(DeadlineExceeded):
        await registry.register(RECORD, trio.current_time())
    with pytest.raises(ValueError):
        registry.inject("bogus", Fault.drop())  # type: ignore[arg-type]


async def test_lose_ack_applies(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry()
    registry.inject("register", Fault.lose_ack())
    with pytest.raises(OutcomeUnknown):
        await registry.register(RECORD, later())
    assert registry.instance_ids() == ("o-1",)


async def test_drop_never_applies(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry()
    registry.inject("register", Fault.drop())
    with pytest.raises(OutcomeUnknown):
        await registry.register(RECORD, later())
    await trio.sleep(100)
    assert registry.instance_ids() == ()


async def test_land_later_after_delay_even_after_deregistration(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    registered = await registry.register(RECORD, later())
    registry.inject("register", Fault.land_later(5.0))
    with pytest.raises(OutcomeUnknown):
        await registry.register(RECORD, later())
    await registry.deregister(registered, later())
    assert registry.instance_ids() == ()
    await trio.sleep(5)
    assert registry.instance_ids() == ("o-1",)  # the late write re-created it


async def test_late_renewal_recreates_only_without_idempotence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    for idempotent, expected in ((True, ()), (False, ("o-1",))):
        registry = MemoryRegistry(idempotent_renewal=idempotent)
        registered = await registry.register(RECORD, later())
        registry.inject("renew", Fault.land_later())
        with pytest.raises(OutcomeUnknown):
            await registry.renew(registered, later())
        await registry.deregister(registered, later())
        assert registry.land_held() == 1
        assert registry.instance_ids() == expected


async def test_slow_write_times_out_then_lands(autojump_clock: trio.testing.MockClock) -> None:
    registry = MemoryRegistry()
    registry.inject("register", Fault.slow(10.0))
    t0 = trio.current_time()
    with pytest.raises(OutcomeUnknown):
        await registry.register(RECORD, t0 + 3.0)
    assert trio.current_time() == pytest.approx(t0 + 3.0)
    assert registry.instance_ids() == ()
    await trio.sleep(7.0)
    assert registry.instance_ids() == ("o-1",)


async def test_failures_revocation_health_and_leases(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry(lease_ttl=10.0)
    registered = await registry.register(RECORD, later())
    registry.inject("check", Fault.fail(IncompleteSnapshot("flap")))
    with pytest.raises(IncompleteSnapshot):
        await registry.check(registered, later())
    registry.script_health("o-1", HealthStatus.UNHEALTHY, HealthStatus.DISABLED)
    assert await registry.check(registered, later()) is HealthStatus.UNHEALTHY
    assert await registry.check(registered, later()) is HealthStatus.DISABLED
    assert await registry.check(registered, later()) is HealthStatus.HEALTHY
    registry.set_health("o-1", HealthStatus.UNHEALTHY)
    assert await registry.check(registered, later()) is HealthStatus.UNHEALTHY
    registry.revoke_identity()
    with pytest.raises(IdentityRevoked):
        await registry.renew(registered, later())
    registry.restore_identity()
    await trio.sleep(8)
    await registry.renew(registered, later())  # extends the lease
    await trio.sleep(8)
    assert registry.instance_ids() == ("o-1",)
    await trio.sleep(3)
    assert registry.instance_ids() == ()  # lapsed
    with pytest.raises(LeaseLost):
        await registry.renew(registered, later())
    again = await registry.register(RECORD, later())
    registry.expire("o-1")
    assert await registry.check(again, later()) is HealthStatus.MISSING
    assert "records=0" in repr(registry)


@pytest.mark.parametrize("declared", [False, True])
def test_the_memory_provider_declares_what_its_registry_can_do(declared: bool) -> None:
    registry = MemoryRegistry(
        idempotent_renewal=declared,
        idempotent_register=declared,
        deregister_without_handle=declared,
    )
    capabilities = MemoryProvider(services={"self": "order-api"}, registry=registry).capabilities
    assert capabilities.registration
    assert capabilities.idempotent_renewal is declared
    assert capabilities.idempotent_register is declared
    assert capabilities.deregister_without_handle is declared
