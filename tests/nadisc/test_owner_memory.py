"""The public in-memory provider used by the owner tests and by hosts."""

from __future__ import annotations

import anyio
import pytest

from nadisc import (
    EvidenceKind,
    HealthStatus,
    IdentityRevoked,
    Registered,
    RegistrationRecord,
    RegistrationRejected,
)
from nadisc.testing import MemoryProvider

from .owner_support import inst


class Registry:
    idempotent_renewal = True

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        self.calls.append("register")
        return Registered(record, "lease-1")

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        self.calls.append("renew")
        return registered

    async def check(self, registered: Registered, deadline: float) -> HealthStatus:
        self.calls.append("check")
        return HealthStatus.HEALTHY

    async def deregister(self, registered: Registered, deadline: float) -> None:
        self.calls.append("deregister")


RECORD = RegistrationRecord("web", "order-api", "order-api-1", "10.0.0.5", 8080)


async def test_without_a_registry_registration_is_refused() -> None:
    p = MemoryProvider()
    assert not p.capabilities.registration
    with pytest.raises(RegistrationRejected):
        await p.register(RECORD, anyio.current_time() + 1)
    with pytest.raises(RegistrationRejected):
        await p.deregister(Registered(RECORD, "x"), anyio.current_time() + 1)


async def test_registration_calls_are_delegated() -> None:
    registry = Registry()
    p = MemoryProvider(registry=registry)
    assert p.capabilities.registration and p.capabilities.idempotent_renewal
    deadline = anyio.current_time() + 1
    registered = await p.register(RECORD, deadline)
    assert registered.handle == "lease-1"
    assert await p.renew(registered, deadline) is registered
    assert await p.check(registered, deadline) is HealthStatus.HEALTHY
    await p.deregister(registered, deadline)
    assert registry.calls == ["register", "renew", "check", "deregister"]


async def test_listings_faults_and_counters() -> None:
    p = MemoryProvider(evidence=EvidenceKind.LEASE)
    p.set("svc", [inst("a")])
    deadline = anyio.current_time() + 1
    assert (await p.query("svc", deadline)).evidence is EvidenceKind.LEASE
    p.fail("svc", IdentityRevoked("403"), times=2)
    for _ in range(2):
        with pytest.raises(IdentityRevoked):
            await p.query("svc", deadline)
    assert (await p.query("svc", deadline)).identities() == ("a",)
    assert (await p.query("unknown", deadline)).instances == ()  # nothing listed: empty
    assert p.query_counts["svc"] == 4
    assert dict(p.bindings()) == {"svc": "svc"}
    p.fail_prepare(IdentityRevoked("bad password"))
    with pytest.raises(IdentityRevoked):
        await p.prepare(deadline)
    p.fail_prepare(None)
    await p.prepare(deadline)
    assert p.prepare_calls == 2
    with pytest.raises(ValueError):
        p.set_latency(-1)


def test_watch_mode_switch() -> None:
    p = MemoryProvider(watch=True, watch_streams=2)
    assert p.capabilities.watch_streams == 2
    p.set_watch(False)
    assert p.capabilities.watch_streams == 0
    with pytest.raises(ValueError):
        MemoryProvider(watch=True, watch_streams=0)
