"""Named connections: the fixed default ``primary``, explicit selection, no fallback."""

from __future__ import annotations

import anyio
import pytest

from nadisc import (
    ConfigError,
    DiscoveryConfig,
    EvidenceUnavailable,
    IdentityRevoked,
    OwnerBuilder,
    ProviderNotFound,
    QualifierError,
    UnknownService,
    open_discovery,
)
from nadisc.testing import MemoryProvider

from .owner_support import all_tasks, inst, memory_owner


def memory(identity: str) -> MemoryProvider:
    p = MemoryProvider(services={"orders": "orders"})
    p.set("orders", [inst(identity)])
    return p


async def test_unqualified_selection_uses_primary(autojump_clock: object) -> None:
    async with memory_owner({"business": memory("b"), "primary": memory("p")}) as owner:
        assert owner.client().qualifier == "primary"
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        assert obs.snapshot().identities() == ("p",)
        obs = await owner.client("business").observe("orders", anyio.current_time() + 5)
        assert obs.snapshot().identities() == ("b",)


async def test_no_primary_means_no_default_even_with_one_connection(
    autojump_clock: object,
) -> None:
    async with memory_owner({"business": memory("b")}) as owner:
        with pytest.raises(QualifierError, match="primary"):
            owner.client()
        assert owner.client("business").qualifier == "business"


async def test_default_is_case_sensitive(autojump_clock: object) -> None:
    async with memory_owner({"Primary": memory("x"), "PRIMARY": memory("y")}) as owner:
        with pytest.raises(QualifierError):
            owner.client()
        with pytest.raises(QualifierError):
            owner.client("primary")


async def test_legacy_default_connection_wins(autojump_clock: object) -> None:
    async with memory_owner(
        {"primary": memory("p"), "legacy": memory("l")}, default="legacy"
    ) as owner:
        assert owner.client().qualifier == "legacy"
        # an explicit qualifier still matches exactly
        assert owner.client("primary").qualifier == "primary"


async def test_unknown_qualifier_is_refused(autojump_clock: object) -> None:
    async with memory_owner({"primary": memory("p")}) as owner:
        with pytest.raises(QualifierError, match="nope"):
            owner.client("nope")


async def test_zero_connections_refuse_internal_lookups_at_once(autojump_clock: object) -> None:
    async with OwnerBuilder().open() as owner:
        await owner.prepare(anyio.current_time() + 1)
        with pytest.raises(QualifierError, match="no connections"):
            owner.client()
        with pytest.raises(QualifierError, match="no connections"):
            owner.client("primary")


async def test_unknown_service_alias(autojump_clock: object) -> None:
    async with memory_owner({"primary": memory("p")}) as owner:
        with pytest.raises(UnknownService, match="payments"):
            await owner.client().observe("payments", anyio.current_time() + 5)


async def test_a_failed_connection_never_falls_back(autojump_clock: object) -> None:
    broken = memory("broken")
    broken.fail("orders", IdentityRevoked("token revoked"))
    healthy = memory("healthy")
    async with memory_owner({"primary": broken, "infra": healthy}) as owner:
        await owner.client("infra").observe("orders", anyio.current_time() + 5)
        obs = await owner.client("primary").observe("orders", anyio.current_time() + 5)
        with pytest.raises(EvidenceUnavailable) as info:
            obs.snapshot()
        assert info.value.reason == "revoked"
        assert obs.connection == "primary"
        assert healthy.query_counts["orders"] == 1


async def test_aliases_map_to_remote_names_per_connection(autojump_clock: object) -> None:
    p = MemoryProvider(services={"orders": "order-worker"})
    p.set("order-worker", [inst("w")])
    p.set("orders", [inst("wrong")])
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        assert obs.snapshot().identities() == ("w",)
        assert owner.client().services() == ("orders",)


async def test_config_bindings_come_from_the_provider_block(autojump_clock: object) -> None:
    cfg = DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "memory",
                    "memory": {"services": {"orders": {"name": "order-worker"}}},
                }
            },
        }
    )
    p = MemoryProvider()
    p.set("order-worker", [inst("w")])
    async with open_discovery(cfg, providers={"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        assert obs.snapshot().identities() == ("w",)


async def test_unknown_provider_says_what_to_install(autojump_clock: object) -> None:
    cfg = DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"business": {"provider": "acme-registry"}}}
    )
    before = all_tasks()
    with pytest.raises(ProviderNotFound) as info:
        async with open_discovery(cfg):
            pytest.fail("must not run")
    assert info.value.path == "discovery.connections.business.provider"
    assert "install" in str(info.value) and "installed: " in str(info.value)
    assert "acme-registry" not in str(info.value)  # config values are not echoed
    assert all_tasks() == before


async def test_injected_provider_for_unknown_connection(autojump_clock: object) -> None:
    cfg = DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"primary": {"provider": "memory"}}}
    )
    with pytest.raises(ConfigError, match=r"providers\.other"):
        async with open_discovery(cfg, providers={"primary": memory("p"), "other": memory("o")}):
            pytest.fail("must not run")


def test_builder_refuses_duplicate_connection_names() -> None:
    from nadisc import ConnectionSpec

    builder = OwnerBuilder().connection(ConnectionSpec("primary", memory("a")))
    with pytest.raises(ConfigError, match="duplicate"):
        builder.connection(ConnectionSpec("primary", memory("b")))


async def test_disabled_discovery_has_no_connections(autojump_clock: object) -> None:
    async with open_discovery(DiscoveryConfig()) as owner:
        assert owner.connection_names() == ()
        with pytest.raises(QualifierError):
            owner.client()
    assert owner.close_report is not None


async def test_non_string_service_alias(autojump_clock: object) -> None:
    async with memory_owner({"primary": memory("p")}) as owner:
        with pytest.raises(UnknownService):
            await owner.client().observe(["orders"], anyio.current_time() + 5)  # type: ignore[arg-type]


def test_registered_provider_whose_module_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from nadisc._registry import forget_settings_models, load_factory

    ghost = importlib.metadata.EntryPoint(
        name="ghost", value="nadisc_no_such_module:factory", group="nadisc.providers"
    )
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [ghost])
    forget_settings_models()  # "installed" now: the group is read again
    try:
        with pytest.raises(ProviderNotFound) as info:
            load_factory("ghost", path="discovery.connections.x.provider")
    finally:
        monkeypatch.undo()
        forget_settings_models()
    assert "nadisc_no_such_module" in str(info.value)
    assert "install" in str(info.value)
    assert info.value.path == "discovery.connections.x.provider"
