"""The catalog as a child of the owner: ``open_catalog(owner, qualifier)``."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import trio
import trio.testing
from nadisc_consul import CatalogSnapshot, ConsulCatalog, ConsulSettings, factory, open_catalog

from nadisc import (
    ConnectionContext,
    DiscoveryConfig,
    LifecycleError,
    Provider,
    QualifierError,
    open_discovery,
    validate_provider_block,
)
from nadisc.testing import MemoryProvider
from tests.fakes.consul import ConsulFake, open_consul_fake, run_consul_fake
from tests.nadisc.owner_support import all_tasks

pytestmark = pytest.mark.trio_only

STATE = "/v1/health/state/any"


def orders(n: int, **extra: Any) -> dict[str, Any]:
    return {
        "Name": "orders",
        "ID": f"orders-{n}",
        "Address": f"10.0.0.{n}",
        "Port": 8000 + n,
        "Check": {"CheckID": f"service:orders-{n}", "TTL": "1h", "Status": "passing"},
        **extra,
    }


def config(url: str, **block: Any) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "consul",
                    "consul": {
                        "url": url,
                        "catalog_wait": 30,
                        "identity_scope": "service",  # see SERVICE_SCOPE in conftest.py
                        **block,
                    },
                },
                "other": {"provider": "memory"},
            },
            "shutdown_timeout_ms": 5000,
        }
    )


def providers(cfg: DiscoveryConfig, fake: ConsulFake) -> dict[str, Provider]:
    connection = cfg.connections["primary"]
    context = ConnectionContext(
        name="primary",
        request_timeout=connection.request_timeout_ms / 1000,
        max_instances_per_service=cfg.limits.max_instances_per_service,
        max_response_bytes=cfg.limits.max_snapshot_bytes,
    )
    settings = validate_provider_block("primary", connection, ConsulSettings)
    return {
        "primary": factory.create_with(context, settings, transport=fake.transport()),
        "other": MemoryProvider(services={}),
    }


async def test_one_catalog_per_connection_started_once_and_gone_after_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before = all_tasks()
    async with open_consul_fake() as fake:
        fake.register(orders(1, Tags=["grpc"], Meta={"nadisc-cluster": "c1"}), now=0.0)
        fake.register(orders(2, Tags=["http"], Meta={"nadisc-cluster": "c2"}), now=0.0)
        cfg = config(fake.url)
        async with open_discovery(cfg, providers=providers(cfg, fake)) as owner:
            found: list[ConsulCatalog] = []

            async def ask() -> None:
                found.append(await open_catalog(owner, "primary"))

            async with anyio.create_task_group() as tg:  # concurrent askers share one start
                for _ in range(3):
                    tg.start_soon(ask)
            catalog = await open_catalog(owner)  # the default connection is "primary"
            assert all(c is catalog for c in found)
            primes = [r for r in fake.requests if r.path == STATE and "index" not in r.query]
            assert len(primes) == 1  # the worker started once
            stats = catalog.statistics()
            assert stats.running and stats.failures == 0
            # Filled before open_catalog returned.
            first, second = catalog.resolve("orders"), catalog.resolve("orders")
            assert first is not None and second is not None
            assert (first.instance.identity, second.instance.identity) == ("orders-1", "orders-2")
            (grpc,) = catalog.list("grpc", {"nadisc-cluster": "c1"})
            assert [i.identity for i in grpc.instances] == ["orders-1"]
            changes = catalog.changes()
            start = anyio.current_time()
            fake.register(orders(3), now=anyio.current_time())
            with anyio.fail_after(5):
                snapshot: CatalogSnapshot = await changes.receive()
            assert anyio.current_time() - start < 1.0  # far below the 30 s catalog wait
            assert [i.identity for i in snapshot.services["orders"]] == [
                "orders-1",
                "orders-2",
                "orders-3",
            ]
            stats = catalog.statistics()
            assert stats.topology_wins + stats.health_wins >= 1 and stats.rebuilds >= 2
            with pytest.raises(QualifierError, match="not Consul"):
                await open_catalog(owner, "other")
            with pytest.raises(QualifierError, match="unknown connection"):
                await open_catalog(owner, "nope")
            owner.begin_quiesce(anyio.current_time() + 5)
            with pytest.raises(LifecycleError):
                await open_catalog(owner)
            closed_stream = catalog.changes()
        assert not catalog.statistics().running
        with pytest.raises(anyio.EndOfStream):
            await closed_stream.receive()
        report = owner.close_report
        assert report is not None and report.tasks_left == 0
    assert all_tasks() == before


async def test_catalog_of_an_entry_point_provider_over_loopback_sees_recovery_quickly() -> None:
    before = all_tasks()
    async with run_consul_fake() as fake:
        fake.register(orders(1), now=anyio.current_time())
        fake.register(orders(2), now=anyio.current_time())
        cfg = DiscoveryConfig.model_validate(
            {
                "enabled": True,
                "connections": {
                    "primary": {
                        "provider": "consul",
                        "consul": {
                            "url": fake.url,
                            "catalog_wait": 30,
                            "identity_scope": "service",
                        },
                    }
                },
            }
        )
        async with open_discovery(cfg) as owner:
            catalog = await open_catalog(owner)
            assert catalog is await open_catalog(owner, "primary")
            changes = catalog.changes()
            fake.set_check("service:orders-2", "critical")
            with anyio.fail_after(2):
                down = await changes.receive()
            assert [i.identity for i in down.services["orders"]] == ["orders-1"]
            start = anyio.current_time()
            fake.set_check("service:orders-2", "passing")
            with anyio.fail_after(2):
                up = await changes.receive()
            # critical -> passing within one blocking round trip, no topology
            # change: measured about 30 ms, bounded at 30x that.
            assert anyio.current_time() - start < 1.0
            assert [i.identity for i in up.services["orders"]] == ["orders-1", "orders-2"]
            assert up.topology_index == down.topology_index
        assert not catalog.statistics().running
    assert all_tasks() == before
