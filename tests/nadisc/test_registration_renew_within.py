"""Renewals keep up with the provider's lease: ``Capabilities.renew_within``.

A lease-based registry drops a record that is not renewed within its TTL.
The connection's ``monitor_interval_ms`` knows nothing about that TTL, so a
provider declares ``renew_within`` and the runner renews at
``min(monitor_interval, renew_within)``. Driven on trio's MockClock with a
``MemoryRegistry`` whose leases lapse after 3 s while the owner monitors
only every 5 s.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from contextlib import AbstractAsyncContextManager

import pytest
import trio
import trio.testing

from nadisc import (
    Capabilities,
    DiscoveryConfig,
    DiscoveryOwner,
    Eligibility,
    EvidenceKind,
    Registered,
    RegistrationState,
    RegistrationTiming,
    open_discovery,
)
from nadisc._registration import renewal_interval
from nadisc.testing import MemoryProvider, MemoryRegistry

from .owner_support import all_tasks
from .test_lifecycle_config import connection, discovery, registration

pytestmark = pytest.mark.trio_only

WEB = ("10.0.0.5", 18080)
INSTANCE = "order-api-10.0.0.5-18080"
TTL = 3.0


class LeaseProvider(MemoryProvider):
    """A memory provider that declares how soon its leases need a renewal."""

    def __init__(self, registry: MemoryRegistry, renew_within: float | None) -> None:
        super().__init__(registry=registry)
        self._renew_within = renew_within

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities, renew_within=self._renew_within)


class TimedRegistry(MemoryRegistry):
    """Remembers when each renewal arrived."""

    def __init__(self) -> None:
        super().__init__(idempotent_renewal=True, lease_ttl=TTL)
        self.renewed_at: list[float] = []

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        self.renewed_at.append(trio.current_time())
        return await super().renew(registered, deadline)


def config_with_slow_monitoring() -> DiscoveryConfig:
    return discovery(
        {"primary": connection(monitor_interval_ms=5000, observation_grace_ms=15_000)},
        {"business-http": registration()},
    )


def open_owner(provider: LeaseProvider) -> AbstractAsyncContextManager[DiscoveryOwner]:
    return open_discovery(
        config_with_slow_monitoring(),
        providers={"primary": provider},
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
    )


async def run_for(registry: TimedRegistry, renew_within: float | None, seconds: float) -> list[str]:
    """Publish one registration, sample its state every 100 ms for ``seconds``."""
    provider = LeaseProvider(registry, renew_within)
    states: list[str] = []
    before = all_tasks()
    async with open_owner(provider) as owner:
        end = trio.current_time() + seconds
        while trio.current_time() < end:
            state = owner.registrations()["business-http"].state
            states.append(state.value)
            await trio.sleep(0.1)
    assert all_tasks() == before
    return states


async def test_renewals_follow_renew_within_and_the_lease_stays_alive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = TimedRegistry()
    states = await run_for(registry, renew_within=1.0, seconds=20.0)
    # Renewed every second (not every 5 s): the 3 s lease never lapsed.
    gaps = [b - a for a, b in zip(registry.renewed_at, registry.renewed_at[1:], strict=False)]
    assert len(registry.renewed_at) >= 18
    assert gaps and max(gaps) <= 1.0 + 1e-6
    assert set(states) == {RegistrationState.ACTIVE.value}
    assert [o for _, o in registry.operations("renew")].count("ok") == len(registry.renewed_at)
    assert [name for name, _ in registry.operations()][-1] == "deregister"


async def test_without_renew_within_the_monitor_interval_paces_renewals(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The control case: renewals every 5 s let a 3 s lease lapse in between,
    # and the lifecycle sees it (lease lost, then re-registered).
    registry = TimedRegistry()
    states = await run_for(registry, renew_within=None, seconds=20.0)
    gaps = [b - a for a, b in zip(registry.renewed_at, registry.renewed_at[1:], strict=False)]
    assert gaps and min(gaps) >= 5.0 - 1e-6
    assert "LeaseLost" in [o for _, o in registry.operations("renew")]
    assert RegistrationState.ACTIVE.value in states
    assert len([o for o, _ in registry.operations() if o == "register"]) >= 2


def test_renewal_interval_is_the_smaller_of_the_two() -> None:
    timing = RegistrationTiming(monitor_interval=5.0)
    lease = Capabilities(evidence=EvidenceKind.LEASE, registration=True)
    assert renewal_interval(timing, lease) == 5.0
    assert renewal_interval(timing, dataclasses.replace(lease, renew_within=1.5)) == 1.5
    assert renewal_interval(timing, dataclasses.replace(lease, renew_within=60.0)) == 5.0


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "1"])
def test_renew_within_must_be_a_positive_finite_number(bad: object) -> None:
    with pytest.raises(ValueError, match="renew_within"):
        Capabilities(evidence=EvidenceKind.LEASE, renew_within=bad)  # type: ignore[arg-type]


class RepacingRegistry(TimedRegistry):
    """Answers each renewal with the pace it wants next (``Registered.renew_within``),
    as Nacos's beat answer carries ``clientBeatInterval``."""

    def __init__(self) -> None:
        super().__init__()
        self.pace: float | None = None

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        renewed = await super().renew(registered, deadline)
        return dataclasses.replace(renewed, renew_within=self.pace)


async def test_a_pace_learned_from_a_renewal_re_paces_the_running_registration(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = RepacingRegistry()
    provider = LeaseProvider(registry, renew_within=2.0)
    async with open_owner(provider) as owner:
        await trio.sleep(10)
        assert len(registry.renewed_at) in range(4, 7)  # the provider's 2 s
        registry.pace = 0.5  # the registry now asks for a renewal every 0.5 s
        await trio.sleep(2.5)  # the next renewal carries it
        start = len(registry.renewed_at)
        await trio.sleep(10)
        assert len(registry.renewed_at) - start in range(19, 22)
        gaps = [b - a for a, b in itertools.pairwise(registry.renewed_at[start:])]
        assert gaps and max(gaps) <= 0.5 + 1e-6
        assert owner.registrations()["business-http"].state is RegistrationState.ACTIVE


def test_the_registrations_own_pace_replaces_the_providers() -> None:
    timing = RegistrationTiming(monitor_interval=5.0)
    lease = Capabilities(evidence=EvidenceKind.LEASE, registration=True, renew_within=1.5)
    registered = Registered(record=None, handle="h")  # type: ignore[arg-type]
    assert renewal_interval(timing, lease, registered) == 1.5
    assert renewal_interval(timing, lease, dataclasses.replace(registered, renew_within=3.0)) == 3.0
    assert renewal_interval(timing, lease, dataclasses.replace(registered, renew_within=9.0)) == 5.0
    with pytest.raises(ValueError, match="renew_within"):
        Registered(record=None, handle="h", renew_within=math.nan)  # type: ignore[arg-type]
