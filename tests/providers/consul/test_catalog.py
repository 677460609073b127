"""The catalog: two raced blocking queries, atomic snapshots, resolve/list, changes."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import trio
import trio.testing
from nadisc_consul import CatalogSnapshot, ConsulCatalog, catalog_for

from nadisc import LifecycleError
from tests.fakes.consul import ConsulFake, Fault, run_consul_fake
from tests.providers.consul.conftest import context, in_process, over_loopback


def orders(n: int, **extra: Any) -> dict[str, Any]:
    return {
        "Name": "orders",
        "ID": f"orders-{n}",
        "Address": f"10.0.0.{n}",
        "Port": 8000 + n,
        "Check": {"CheckID": f"service:orders-{n}", "TTL": "1h", "Status": "passing"},
        **extra,
    }


def populated() -> ConsulFake:
    fake = ConsulFake()
    fake.register(orders(1, Tags=["grpc"], Meta={"nadisc-cluster": "c1"}), now=0.0)
    fake.register(orders(2, Tags=["grpc", "x"], Meta={"nadisc-cluster": "c2"}), now=0.0)
    fake.register(orders(3, Tags=["http"], Meta={"nadisc-cluster": "c1"}), now=0.0)
    fake.register({"Name": "db", "ID": "db-1", "Port": 5432, "Tags": ["grpc"]}, now=0.0)
    return fake


async def test_one_catalog_per_connection_started_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = in_process(ConsulFake())
    catalog = catalog_for(provider)
    assert catalog_for(provider) is catalog
    assert catalog_for(in_process(ConsulFake())) is not catalog
    async with anyio.create_task_group() as nursery:
        await nursery.start(catalog.run)
        with pytest.raises(LifecycleError, match="runs once"):
            await catalog.run()
        nursery.cancel_scope.cancel()
    with pytest.raises(LifecycleError):
        await catalog.run()
    await provider.aclose()


async def test_resolve_round_robins_over_every_instance_ignoring_tags(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = in_process(populated())
    catalog = ConsulCatalog(provider)
    assert catalog.resolve("orders") is None  # nothing built yet
    async with anyio.create_task_group() as nursery:
        await nursery.start(catalog.run)
        picks = [catalog.resolve("orders") for _ in range(6)]
        assert [p.instance.identity for p in picks if p] == [
            "orders-1",
            "orders-2",
            "orders-3",
            "orders-1",
            "orders-2",
            "orders-3",
        ]
        first = picks[0]
        assert first is not None and first.address == "10.0.0.1:8001"
        assert first.service == "orders" and first.port == 8001
        assert catalog.resolve("missing") is None
        db = catalog.resolve("db")
        assert db is not None and db.host == "127.0.0.1"  # node address fallback
        nursery.cancel_scope.cancel()
    await provider.aclose()


async def test_list_filters_at_instance_granularity(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = in_process(populated())
    catalog = ConsulCatalog(provider)
    async with anyio.create_task_group() as nursery:
        await nursery.start(catalog.run)
        c1 = catalog.list("grpc", {"nadisc-cluster": "c1"})
        assert [(s.name, [i.identity for i in s.instances]) for s in c1] == [
            ("orders", ["orders-1"])
        ]
        c2 = catalog.list("grpc", {"nadisc-cluster": "c2"})
        assert [(s.name, [i.identity for i in s.instances]) for s in c2] == [
            ("orders", ["orders-2"])
        ]
        grpc = catalog.list("grpc")
        assert [(s.name, len(s.instances)) for s in grpc] == [("db", 1), ("orders", 2)]
        assert catalog.list("absent") == ()
        assert {s.name for s in catalog.list()} == {"consul", "db", "orders"}
        nursery.cancel_scope.cancel()
    await provider.aclose()


async def test_unhealthy_instances_are_not_in_the_catalog_and_failures_keep_the_last_snapshot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = populated()
    fake.set_check("service:orders-2", "critical")
    provider = in_process(fake, catalog_wait=60.0, initial_backoff=1.0, max_backoff=2.0)
    catalog = ConsulCatalog(provider)
    async with anyio.create_task_group() as nursery:
        await nursery.start(catalog.run)
        before = catalog.snapshot()
        assert [i.identity for i in before.services["orders"]] == ["orders-1", "orders-3"]
        fake.inject("/v1/catalog/services", Fault("status", status=500, body=b"No leader"), times=3)
        fake.inject("/v1/health/state/any", Fault("status", status=500, body=b"No leader"), times=3)
        fake.set_check("service:orders-2", "passing")  # wakes the health query
        await anyio.sleep(0.5)
        assert catalog.snapshot() is before  # still serving the last good snapshot
        stats = catalog.statistics()
        assert stats.failures >= 1 and stats.last_error is not None
        assert "No leader" in stats.last_error
        await anyio.sleep(10)
        assert len(catalog.snapshot().services["orders"]) == 3
        nursery.cancel_scope.cancel()
    await provider.aclose()


async def test_equal_rebuilds_publish_nothing_and_changes_are_latest_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = populated()
    provider = in_process(fake, catalog_wait=60.0)
    catalog = ConsulCatalog(provider)
    async with anyio.create_task_group() as nursery:
        await nursery.start(catalog.run)
        changes = catalog.changes()
        fake.set_check("service:orders-1", "passing", "new output only")  # index moves
        await anyio.sleep(1)
        assert catalog.statistics().rebuilds == 2
        assert not changes.pending  # same content: no publish
        fake.set_check("service:orders-1", "critical")
        await anyio.sleep(1)
        fake.set_check("service:orders-3", "critical")
        await anyio.sleep(1)
        latest = await changes.receive()  # two swaps, one (the newest) delivered
        assert [i.identity for i in latest.services["orders"]] == ["orders-2"]
        assert not changes.pending
        nursery.cancel_scope.cancel()
    # the worker stopped: subscribers reach the end of the stream
    with pytest.raises(anyio.EndOfStream):
        await changes.receive()
    await provider.aclose()


# -- over loopback: racing, cancelling and awaiting the loser ------------------------------


async def test_peer_recovery_is_seen_within_one_round_trip_without_topology_change() -> None:
    async with run_consul_fake() as fake:
        fake.register(orders(1), now=anyio.current_time())
        fake.register(orders(2), now=anyio.current_time())
        provider = over_loopback(fake, catalog_wait=30.0)
        catalog = catalog_for(provider)
        async with anyio.create_task_group() as nursery:
            await nursery.start(catalog.run)
            initial = catalog.snapshot()
            changes = catalog.changes()

            async def next_snapshot() -> tuple[CatalogSnapshot, float]:
                start = anyio.current_time()
                with anyio.fail_after(2):  # far below catalog_wait: the health index woke us
                    snapshot = await changes.receive()
                return snapshot, anyio.current_time() - start

            fake.set_check("service:orders-2", "critical")
            down, _ = await next_snapshot()
            assert [i.identity for i in down.services["orders"]] == ["orders-1"]
            fake.set_check("service:orders-2", "passing")
            up, elapsed = await next_snapshot()
            assert [i.identity for i in up.services["orders"]] == ["orders-1", "orders-2"]
            # Measured about 10 ms; 1 s is 100x that and still a 30th of the
            # 30 s catalog wait a missed wake-up would take.
            assert elapsed < 1.0
            assert up.topology_index == down.topology_index == initial.topology_index
            stats = catalog.statistics()
            assert stats.health_wins >= 2 and stats.topology_wins == 0
            nursery.cancel_scope.cancel()
        await provider.aclose()


async def test_the_losing_query_is_cancelled_awaited_and_reissued_with_its_index() -> None:
    async with run_consul_fake() as fake:
        fake.register(orders(1), now=anyio.current_time())
        provider = over_loopback(fake, catalog_wait=30.0)
        catalog = catalog_for(provider)
        async with anyio.create_task_group() as nursery:
            await nursery.start(catalog.run)
            changes = catalog.changes()
            with anyio.fail_after(5):
                await fake.wait_for(lambda: fake.open_requests("/v1/catalog/services") == 1)
            topology_before = [
                r for r in fake.requests if r.path == "/v1/catalog/services" and "index" in r.query
            ]
            fake.set_check("service:orders-1", "critical")  # health wins this pass
            with anyio.fail_after(5):
                await changes.receive()
            # The pass (race + rebuild) has returned: the loser was cancelled and awaited
            # on our side, so the agent sees its connection closed, not abandoned.
            assert catalog.statistics().cancelled_losers >= 1
            with anyio.fail_after(5):
                await fake.wait_for(lambda: topology_before[0].outcome != "open")
            assert topology_before[0].outcome == "disconnected"
            with anyio.fail_after(5):
                await fake.wait_for(
                    lambda: (
                        len(
                            [
                                r
                                for r in fake.requests
                                if r.path == "/v1/catalog/services" and "index" in r.query
                            ]
                        )
                        > len(topology_before)
                    )
                )
            reissued = [
                r for r in fake.requests if r.path == "/v1/catalog/services" and "index" in r.query
            ][len(topology_before)]
            assert reissued.query["index"] == topology_before[0].query["index"]
            assert reissued.query["wait"] == "30s"
            assert fake.open_requests("/v1/catalog/services") <= 1
            nursery.cancel_scope.cancel()
        await provider.aclose()


async def test_a_new_service_wins_through_the_topology_query() -> None:
    async with run_consul_fake() as fake:
        provider = over_loopback(fake, catalog_wait=30.0)
        catalog = catalog_for(provider)
        async with anyio.create_task_group() as nursery:
            await nursery.start(catalog.run)
            changes = catalog.changes()
            fake.register({"Name": "fresh", "Port": 9999}, now=anyio.current_time())  # no checks
            with anyio.fail_after(2):
                snapshot = await changes.receive()
            assert "fresh" in snapshot.services
            assert catalog.statistics().topology_wins >= 1
            nursery.cancel_scope.cancel()
        await provider.aclose()


async def test_index_reset_re_primes_both_queries_and_keeps_converging(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = populated()
    provider = in_process(fake, catalog_wait=60.0)
    catalog = ConsulCatalog(provider)
    async with anyio.create_task_group() as nursery:
        await nursery.start(catalog.run)
        high = catalog.snapshot().topology_index
        fake.reset_index(to=1)  # the agent's state was restored from an older snapshot
        await anyio.sleep(60 * 17 / 16 + 1)  # the blocked queries return at their wait
        fake.register({"Name": "after-reset", "Port": 1}, now=anyio.current_time())
        await anyio.sleep(1)
        snapshot = catalog.snapshot()
        assert "after-reset" in snapshot.services
        assert snapshot.topology_index < high
        nursery.cancel_scope.cancel()
    await provider.aclose()


async def test_one_service_over_the_instance_limit_does_not_empty_the_catalog(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake(seed=1)
    fake.register(orders(1), now=0.0)
    for n in range(3):
        fake.register({"Name": "big", "ID": f"big-{n}", "Port": 80}, now=0.0)
    provider = in_process(fake, ctx=context(max_instances_per_service=3))
    catalog = ConsulCatalog(provider)
    async with anyio.create_task_group() as nursery:
        await nursery.start(catalog.run)
        assert [i.identity for i in catalog.snapshot().services["big"]] == [
            "big-0",
            "big-1",
            "big-2",
        ]
        changes = catalog.changes()
        fake.register({"Name": "big", "ID": "big-3", "Port": 80}, now=anyio.current_time())
        fake.register(orders(2), now=anyio.current_time())
        snapshot = await changes.receive()
        # The rest publishes; the oversized service keeps what it had.
        assert [i.identity for i in snapshot.services["orders"]] == ["orders-1", "orders-2"]
        assert [i.identity for i in snapshot.services["big"]] == ["big-0", "big-1", "big-2"]
        stats = catalog.statistics()
        assert set(stats.rejected) == {"big"} and stats.rejected["big"].startswith("capacity")
        assert stats.rejections >= 1 and stats.failures == 0 and stats.last_error is None
        passes = stats.rebuilds
        await anyio.sleep(300)  # no retry storm: rebuilds follow changes only
        assert catalog.statistics().rebuilds - passes <= 1
        fake.deregister("big-3")
        await anyio.sleep(5)  # an equal snapshot: nothing published, the record clears
        assert catalog.statistics().rejected == {}
        nursery.cancel_scope.cancel()
    await provider.aclose()


async def test_an_oversized_service_never_seen_before_is_empty_not_fatal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake(seed=1)
    fake.register(orders(1), now=0.0)
    for n in range(5):
        fake.register({"Name": "big", "ID": f"big-{n}", "Port": 80}, now=0.0)
    provider = in_process(fake, ctx=context(max_instances_per_service=4))
    catalog = ConsulCatalog(provider)
    async with anyio.create_task_group() as nursery:
        await nursery.start(catalog.run)
        assert catalog.snapshot().services["big"] == ()
        resolved = catalog.resolve("orders")
        assert resolved is not None and resolved.instance.identity == "orders-1"
        assert catalog.resolve("big") is None
        assert "big" in catalog.statistics().rejected
        nursery.cancel_scope.cancel()
    await provider.aclose()


async def test_least_privilege_token_builds_the_readable_part_of_the_catalog(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = populated()
    fake.enable_acl()
    fake.add_token("orders-only", read=("orders",), write=())
    provider = in_process(fake, token="orders-only")
    catalog = ConsulCatalog(provider)
    async with anyio.create_task_group() as nursery:
        await nursery.start(catalog.run)
        # /v1/catalog/services is filtered for this token: normal, not a revocation.
        assert set(catalog.snapshot().services) == {"orders"}
        stats = catalog.statistics()
        assert stats.failures == 0 and stats.rejected == {}
        nursery.cancel_scope.cancel()
    await provider.aclose()


async def test_a_service_whose_health_read_is_acl_filtered_is_left_out_with_a_reason(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = populated()
    fake.enable_acl()
    fake.add_token("t", read=("",), write=())
    provider = in_process(fake, token="t")
    catalog = ConsulCatalog(provider)
    async with anyio.create_task_group() as nursery:
        await nursery.start(catalog.run)
        assert {"db", "orders"} <= set(catalog.snapshot().services)
        # The catalog listing still names "db" (read on the catalog prefix) but
        # the per-service health read of "db" is now trimmed by the ACLs.
        original = fake.health_service

        def trimmed(name: str, **options: Any) -> tuple[int, list[dict[str, Any]], bool]:
            index, entries, filtered = original(name, **options)
            return (index, [], True) if name == "db" and entries else (index, entries, filtered)

        fake.health_service = trimmed  # type: ignore[method-assign]
        changes = catalog.changes()
        fake.register(orders(4), now=anyio.current_time())
        snapshot = await changes.receive()
        assert "db" not in snapshot.services
        assert len(snapshot.services["orders"]) == 4
        stats = catalog.statistics()
        assert stats.rejected["db"].startswith("filtered") and stats.failures == 0
        nursery.cancel_scope.cancel()
    await provider.aclose()


async def test_snapshots_are_read_only_and_old_ones_never_change(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake(seed=1)
    fake.register(orders(1), now=0.0)
    provider = in_process(fake, catalog_wait=60.0)
    catalog = ConsulCatalog(provider)
    async with anyio.create_task_group() as nursery:
        await nursery.start(catalog.run)
        old = catalog.snapshot()
        with pytest.raises(TypeError):
            old.services["intruder"] = ()  # type: ignore[index]
        built = CatalogSnapshot(services={"orders": ()})
        with pytest.raises(TypeError):
            built.services["intruder"] = ()  # type: ignore[index]
        changes = catalog.changes()
        fake.register(orders(2), now=anyio.current_time())
        new = await changes.receive()
        assert [i.identity for i in old.services["orders"]] == ["orders-1"]
        assert [i.identity for i in new.services["orders"]] == ["orders-1", "orders-2"]
        nursery.cancel_scope.cancel()
    await provider.aclose()
