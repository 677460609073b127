"""Cancellation while ``open_discovery`` enters: providers closed, a close report left.

Runs on both loops with real time: the cancellation lands on the first
checkpoint after the (synchronous) provider construction.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
from pydantic import BaseModel

import nadisc._owner as owner_module
from nadisc import ConnectionContext, DiscoveryConfig, DiscoveryOwner, Phase, open_discovery
from nadisc.testing import MemoryProvider

from .owner_support import all_tasks


class _NoSettings(BaseModel):
    pass


class SlowFactory:
    """A provider factory whose ``create`` takes synchronous time (as
    creating an httpx client does) and records what it made."""

    name = "slow"
    settings_model = _NoSettings

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.made: list[MemoryProvider] = []

    def create(self, context: ConnectionContext, settings: BaseModel) -> MemoryProvider:
        time.sleep(self.seconds)
        provider = MemoryProvider()
        self.made.append(provider)
        return provider


CONFIG = DiscoveryConfig.model_validate(
    {
        "enabled": True,
        "connections": {"primary": {"provider": "slow"}, "other": {"provider": "slow"}},
    }
)


@pytest.fixture
def owners(monkeypatch: pytest.MonkeyPatch) -> list[DiscoveryOwner]:
    """Every owner built during the test (the block never sees them)."""
    built: list[DiscoveryOwner] = []
    real = DiscoveryOwner.__init__

    def recording(self: DiscoveryOwner, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(DiscoveryOwner, "__init__", recording)
    return built


def use(monkeypatch: pytest.MonkeyPatch, factory: SlowFactory) -> None:
    monkeypatch.setattr(owner_module, "load_factory", lambda name, path="": factory)


async def test_an_already_cancelled_scope_closes_the_providers(
    monkeypatch: pytest.MonkeyPatch, owners: list[DiscoveryOwner]
) -> None:
    factory = SlowFactory(0.0)
    use(monkeypatch, factory)
    before = all_tasks()
    with anyio.CancelScope() as scope:
        scope.cancel()
        async with open_discovery(CONFIG):
            pytest.fail("the body must not run")
    assert scope.cancelled_caught
    assert [p.close_calls for p in factory.made] == [1, 1]
    (owner,) = owners
    assert owner.phase is Phase.CLOSED
    assert owner.close_report is not None
    assert all_tasks() == before


async def test_a_deadline_firing_during_provider_construction_closes_them(
    monkeypatch: pytest.MonkeyPatch, owners: list[DiscoveryOwner]
) -> None:
    factory = SlowFactory(0.03)
    use(monkeypatch, factory)
    before = all_tasks()
    with anyio.move_on_after(0.01) as scope:
        async with open_discovery(CONFIG):
            pytest.fail("the body must not run")
    assert scope.cancelled_caught
    assert [p.close_calls for p in factory.made] == [1, 1]
    (owner,) = owners
    assert owner.phase is Phase.CLOSED and owner.close_report is not None
    assert all_tasks() == before
