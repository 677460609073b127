"""DiscoveryOnlyProvider: the shared refusals of discovery-only backends."""

from __future__ import annotations

import pytest

from nadisc import (
    DiscoveryOnlyProvider,
    Instance,
    LifecycleError,
    Registered,
    RegistrationRecord,
    RegistrationRejected,
)
from nadisc.providers._dns import DnsProvider
from nadisc.providers._static import StaticProvider

RECORD = RegistrationRecord(
    registration="web", service="orders", instance_id="orders-1", host="10.0.0.1", port=8080
)


@pytest.mark.parametrize("cls", [StaticProvider, DnsProvider])
def test_builtin_discovery_providers_share_the_base(cls: type) -> None:
    assert issubclass(cls, DiscoveryOnlyProvider)


async def test_registration_calls_refuse_naming_the_provider() -> None:
    provider = StaticProvider({"orders": [Instance("a", "10.0.0.1", 80)]})
    assert not provider.capabilities.registration
    registered = Registered(RECORD, "handle")
    for call in (
        provider.register(RECORD, 0.0),
        provider.renew(registered, 0.0),
        provider.check(registered, 0.0),
        provider.deregister(registered, 0.0),
    ):
        with pytest.raises(RegistrationRejected, match="static provider cannot register"):
            await call


async def test_watch_refuses() -> None:
    provider = StaticProvider({})

    class _Sink:
        def publish(self, snapshot: object) -> None: ...
        def fail(self, failure: object) -> None: ...
        def refresh(self) -> None: ...

    with pytest.raises(LifecycleError, match="static provider holds no watch"):
        await provider.watch("orders", _Sink(), task_status=None)  # type: ignore[arg-type]
