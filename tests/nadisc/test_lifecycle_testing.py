"""``nadisc.testing`` exposes the real in-memory registry under its own name;
the protocol a memory provider delegates to is ``RegistryBackend``."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import nadisc.testing
from nadisc import Eligibility, RegistrationState, open_discovery
from nadisc._memory_registry import Fault as RealFault
from nadisc._memory_registry import MemoryRegistry as RealMemoryRegistry
from nadisc.testing import Fault, FaultKind, MemoryProvider, MemoryRegistry, RegistryBackend

from .test_lifecycle_config import connection, discovery, registration

pytestmark = pytest.mark.trio_only


def test_the_names_are_the_real_classes() -> None:
    assert MemoryRegistry is RealMemoryRegistry
    assert Fault is RealFault
    assert Fault.drop().kind is FaultKind.DROP
    exported = nadisc.testing.__all__
    assert exported == sorted(exported)
    assert set(exported) == {
        "Fault",
        "FaultKind",
        "MemoryProvider",
        "MemoryRegistry",
        "RegistryBackend",
    }
    # RegistryBackend is the protocol; the registry class satisfies it.
    assert getattr(RegistryBackend, "_is_protocol", False)
    backend: RegistryBackend = MemoryRegistry()
    assert MemoryProvider(registry=backend).capabilities.registration


async def test_memory_provider_over_memory_registry_from_the_public_module(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = MemoryRegistry(idempotent_renewal=False)
    provider = MemoryProvider(registry=registry)
    assert provider.capabilities.registration
    assert not provider.capabilities.idempotent_renewal
    cfg = discovery({"primary": connection()}, {"web": registration()})
    async with open_discovery(
        cfg,
        providers={"primary": provider},
        listeners={"web": ("10.0.0.5", 18080)},
        eligibility={"web": Eligibility.always()},
    ) as owner:
        assert owner.registrations()["web"].state is RegistrationState.ACTIVE
        assert registry.instance_ids() == ("order-api-10.0.0.5-18080",)
    assert registry.instance_ids() == ()
