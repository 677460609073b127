"""OwnerRegistrations: the registration set plugged into the owner's seam."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from nadisc import (
    CloseOutcome,
    ConnectionConfig,
    Eligibility,
    OwnerRegistrations,
    RegistrationError,
    RegistrationSpec,
    RegistrationState,
)
from nadisc._memory_registry import MemoryRegistry

from .test_registration_runtime import RegistryProvider

pytestmark = pytest.mark.trio_only

POLICY = ConnectionConfig.model_validate(
    {
        "provider": "memory",
        "monitor_interval_ms": 1000,
        "observation_grace_ms": 5000,
        "request_timeout_ms": 500,
        "deregister_timeout_ms": 700,
    }
)


class FakeConnection:
    def __init__(self, registry: MemoryRegistry) -> None:
        self.provider = RegistryProvider(registry)
        self.policy = POLICY
        self.bindings = {"orders": "orders-svc"}


async def test_adapter_drives_the_set_through_the_seam(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry()
    web = Eligibility.always()
    seam = OwnerRegistrations(listeners={"web": ("10.0.0.5", 8080)}, eligibility={"web": web})
    seam.freeze(
        [RegistrationSpec(name="web", service_name="orders")],
        {"primary": FakeConnection(registry)},
    )
    frozen = seam.registrations.registrations()["web"]
    assert frozen.state is RegistrationState.PENDING
    async with trio.open_nursery() as nursery:
        await seam.publish(nursery, trio.current_time() + 5)
        assert seam.registrations.registrations()["web"].state is RegistrationState.ACTIVE
        await trio.sleep(2.5)
        # The connection's timing is used: renewals every monitor_interval_ms.
        assert len(registry.operations("renew")) == 2
        deadline = trio.current_time() + 5
        seam.begin_quiesce(deadline)
        await seam.drain(deadline)
    (entry,) = seam.report()
    assert entry.outcome is CloseOutcome.DEREGISTERED
    with pytest.raises(RegistrationError, match="expected a RegistrationSpec"):
        OwnerRegistrations().freeze(["web"], {"primary": FakeConnection(registry)})


async def test_with_the_discovery_owner(autojump_clock: trio.testing.MockClock) -> None:
    from nadisc import ConnectionSpec, OwnerBuilder

    registry = MemoryRegistry()
    seam = OwnerRegistrations(eligibility={"web": Eligibility.always()})
    builder = OwnerBuilder().connection(
        ConnectionSpec(
            "primary", RegistryProvider(registry), POLICY, services={"orders": "orders-svc"}
        )
    )
    builder.registrations(seam)
    async with builder.open() as owner:
        await owner.prepare(trio.current_time() + 5)
        owner.freeze_registrations(
            [
                RegistrationSpec(
                    name="web",
                    service_name="orders",
                    ip="10.0.0.5",
                    port=8080,
                    eligibility_ref="web",
                )
            ]
        )
        await owner.publish(trio.current_time() + 5)
        assert seam.registrations.ready()
        assert registry.instance_ids() == ("orders-svc-10.0.0.5-8080",)
    assert registry.instance_ids() == ()
    report = owner.close_report
    assert report is not None
    (entry,) = report.registrations
    assert entry.outcome is CloseOutcome.DEREGISTERED  # type: ignore[attr-defined]


async def test_memory_registry_behind_the_memory_provider(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from nadisc import ConnectionPlan, RegistrationSet
    from nadisc.testing import MemoryProvider

    registry = MemoryRegistry(idempotent_renewal=True)
    provider = MemoryProvider(services={"orders": "orders-svc"}, registry=registry)
    assert provider.capabilities.registration and provider.capabilities.idempotent_renewal
    registrations = RegistrationSet()
    registrations.freeze(
        [
            RegistrationSpec(
                name="web",
                service_name="orders",
                ip="10.0.0.5",
                port=8080,
                eligibility=Eligibility.always(),
            )
        ],
        {"primary": ConnectionPlan(provider.capabilities, {"orders": "orders-svc"})},
    )
    async with trio.open_nursery() as nursery:
        await registrations.publish(nursery, {"primary": provider}, trio.current_time() + 5)
        assert registry.instance_ids() == ("orders-svc-10.0.0.5-8080",)
        registrations.begin_quiesce(trio.current_time() + 5)
        await registrations.wait_drained()
    assert registrations.report()[0].outcome is CloseOutcome.DEREGISTERED
    assert registry.instance_ids() == ()
