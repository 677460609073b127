"""The built-in static provider."""

from __future__ import annotations

import anyio
import pytest

from nadisc import (
    ConfigError,
    ConnectionContext,
    EvidenceKind,
    Instance,
    InvalidSnapshot,
    RegistrationRecord,
    RegistrationRejected,
    StaticConfig,
)
from nadisc._registry import available_providers, load_factory
from nadisc.providers._static import StaticProvider, factory


def context() -> ConnectionContext:
    return ConnectionContext(
        name="primary", request_timeout=3.0, max_instances_per_service=10, max_response_bytes=1000
    )


async def test_answers_complete_static_facts() -> None:
    provider = StaticProvider.static_services(
        {"orders": [Instance("o1", "10.0.0.1", 80), Instance("o2", "10.0.0.2", 80)], "none": []}
    )
    assert provider.capabilities.evidence is EvidenceKind.STATIC_FACT
    assert provider.capabilities.watch_streams == 0
    assert not provider.capabilities.registration
    await provider.prepare(anyio.current_time() + 1)
    snapshot = await provider.query("orders", anyio.current_time() + 1)
    assert snapshot.identities() == ("o1", "o2")
    assert snapshot.evidence is EvidenceKind.STATIC_FACT
    assert (await provider.query("none", anyio.current_time() + 1)).instances == ()
    with pytest.raises(InvalidSnapshot):
        await provider.query("unknown", anyio.current_time() + 1)
    assert dict(provider.bindings()) == {"orders": "orders", "none": "none"}


async def test_cannot_register() -> None:
    provider = StaticProvider({})
    record = RegistrationRecord("r", "svc", "id", "10.0.0.1", 80)
    with pytest.raises(RegistrationRejected):
        await provider.register(record, anyio.current_time() + 1)


def test_duplicate_identities_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"static\.services\.orders"):
        StaticProvider({"orders": [Instance("x", "10.0.0.1", 80), Instance("x", "10.0.0.2", 80)]})


def test_entry_point_names_the_factory() -> None:
    assert "static" in available_providers()
    loaded = load_factory("static")
    assert loaded is factory
    assert loaded.name == "static"
    assert loaded.settings_model is StaticConfig


async def test_factory_builds_from_the_config_block() -> None:
    settings = StaticConfig.model_validate(
        {"services": {"orders": [{"host": "10.0.0.9", "port": 81, "id": "nine"}]}}
    )
    provider = factory.create(context(), settings)
    snapshot = await provider.query("orders", anyio.current_time() + 1)
    assert snapshot.identities() == ("nine",)
    assert snapshot.instances[0].port == 81


def test_factory_refuses_a_foreign_settings_model() -> None:
    from nadisc import DnsConfig

    with pytest.raises(ConfigError):
        factory.create(context(), DnsConfig())
