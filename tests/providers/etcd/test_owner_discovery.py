"""Discovery through the owner against a real etcd: config, changes, bursts,
invalid records, explicit empty, and the route into a streaming balance.

Real time, real server: timings are short (see ``owner_helpers``). Every
test ends by checking that no task of the owner is left.
"""

from __future__ import annotations

import contextlib
import itertools
import json

import anyio
import httpx
import pytest

from nadisc import (
    ConfigError,
    DeadlineExceeded,
    EvidenceKind,
    EvidenceUnavailable,
    Instance,
    ObservationSnapshot,
    RestOptions,
    open_discovery,
)
from nadisc._route import Attempt, Route

from ...nadisc.owner_support import all_tasks
from .conftest import EtcdServer, RawEtcd, both_wires
from .owner_helpers import etcd_config, ids, look, reason, soon, unique_prefix, wait_for

pytestmark = pytest.mark.real_server


@both_wires
async def test_open_discovery_loads_etcd_by_name_and_sees_each_change_at_once(
    etcd_server: EtcdServer, raw: RawEtcd
) -> None:
    prefix = unique_prefix()
    head = f"{prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:8080")
    before = all_tasks()
    # No provider injected: "etcd" comes from the nadisc.providers entry point
    # and its block is validated by the provider's settings model.
    async with open_discovery(
        etcd_config(etcd_server.url, prefix), prepare_deadline=soon()
    ) as owner:
        assert owner.prepared
        orders = await owner.client().observe("orders", soon())
        first = orders.snapshot(strict=True)
        assert first.identities() == ("a",) and first.evidence is EvidenceKind.LEASE

        changes = [
            ("put", "b", "10.0.0.2:8080", {"a": 8080, "b": 8080}),
            ("put", "b", "10.0.0.2:9999", {"a": 8080, "b": 9999}),
            ("delete", "a", None, {"b": 9999}),
        ]
        for op, key, addr, expected in changes:
            seen = orders.snapshot().revision
            began = anyio.current_time()
            if op == "put":
                assert addr is not None
                await raw.put_record(f"{head}/{key}", addr)
            else:
                await raw.delete(f"{head}/{key}")
            # The very next change of the observation carries the write.
            await orders.changed(soon(2.0))
            latency = anyio.current_time() - began
            now = orders.snapshot(strict=True)
            assert now.revision > seen
            assert {i.identity: i.port for i in now.instances} == expected
            assert latency < 1.0, latency

        metrics = owner.observer().snapshot().connection("primary")
        assert metrics.prepared is True and metrics.failures == 0
        (service,) = metrics.services
        assert (service.service, service.instances, service.unavailable_reason) == (
            "orders",
            1,
            None,
        )
    assert owner.close_report is not None and owner.close_report.tasks_left == 0
    assert all_tasks() == before


async def test_a_bad_etcd_block_is_refused_before_anything_runs(etcd_server: EtcdServer) -> None:
    before = all_tasks()
    bad = etcd_config(etcd_server.url, unique_prefix(), etcd={"ttl_seconds": 0})
    with pytest.raises(ConfigError) as refused:
        async with open_discovery(bad):
            raise AssertionError("the owner must not open")
    assert refused.value.path.startswith("discovery.connections.primary.etcd.ttl_seconds")
    secret = etcd_config(
        etcd_server.url, unique_prefix(), etcd={"username": "app", "password": "p4ssw0rd-x"}
    )
    # Both credentials or neither; the password never shows up in messages.
    missing = etcd_config(etcd_server.url, unique_prefix(), etcd={"username": "app"})
    with pytest.raises(ConfigError) as half:
        async with open_discovery(missing):
            raise AssertionError("the owner must not open")
    assert half.value.path.startswith("discovery.connections.primary.etcd")
    assert "p4ssw0rd-x" not in repr(secret)
    assert all_tasks() == before


async def test_a_burst_of_1000_changes_yields_the_newest_state_without_a_backlog(
    etcd_server: EtcdServer, raw: RawEtcd
) -> None:
    prefix = unique_prefix()
    head = f"{prefix}/orders"
    expected = {f"i{n:04d}": 10_000 + n for n in range(1000) if n % 7}

    running: set[int] = set()

    async def writer(worker: int) -> None:
        running.add(worker)
        try:
            await write_share(worker)
        finally:
            running.discard(worker)

    async def write_share(worker: int) -> None:
        for n in range(worker, 1000, 20):
            await raw.put_record(f"{head}/i{n:04d}", f"10.1.{n // 250}.{n % 250 + 1}:{10_000 + n}")
            if n % 7 == 0:
                await raw.delete(f"{head}/i{n:04d}")

    before = all_tasks()
    async with open_discovery(
        etcd_config(etcd_server.url, prefix), prepare_deadline=soon()
    ) as owner:
        await raw.put_record(f"{head}/seed", "10.0.0.1:80")
        orders = await owner.client().observe("orders", soon())
        assert ids(look(orders)) == {"seed"}
        await raw.delete(f"{head}/seed")
        await wait_for(orders, lambda a: reason(a) == "empty")

        revisions: list[int] = []
        async with anyio.create_task_group() as writers:
            for worker in range(20):
                writers.start_soon(writer, worker)
            # A consumer that looks only now and then is never handed the
            # intermediate states one by one: each look is the newest state.
            while ids(answer := look(orders)) != set(expected) or running:
                if isinstance(answer, ObservationSnapshot):
                    revisions.append(answer.revision)
                await orders.changed(soon(20.0))
                await anyio.sleep(0.05)
        final = orders.snapshot(strict=True)
        assert {i.identity: i.port for i in final.instances} == expected
        # 1,143 writes went by; the observation jumped over most of them.
        assert len(revisions) < 400, len(revisions)
        jumps = [b - a for a, b in itertools.pairwise(revisions)]
        assert jumps and max(jumps) > 1
        assert all(j >= 0 for j in jumps)
        # No backlog: at most one changed() brings this handle's cursor to the
        # newest state (none when the last one in the loop already saw it), and
        # nothing is queued behind it.
        with contextlib.suppress(DeadlineExceeded):
            await orders.changed(soon(0.5))
        assert orders.snapshot().revision == final.revision
        with pytest.raises(DeadlineExceeded):
            await orders.changed(soon(0.5))
        assert orders.snapshot().revision == final.revision
    assert all_tasks() == before


async def test_invalid_records_are_counted_and_an_explicit_empty_withdraws_at_once(
    etcd_server: EtcdServer, raw: RawEtcd
) -> None:
    prefix = unique_prefix()
    head = f"{prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:8080")
    await raw.put_record(f"{head}/b", "10.0.0.2:8080")
    await raw.put(f"{head}/not-json", "{nope")
    await raw.put(f"{head}/deleted-op", json.dumps({"Op": 1, "Addr": "10.0.0.9:1"}))
    await raw.put_record(f"{head}/no-port", "10.0.0.3")
    before = all_tasks()
    async with open_discovery(
        etcd_config(etcd_server.url, prefix), prepare_deadline=soon()
    ) as owner:
        orders = await owner.client().observe("orders", soon())
        # The valid rest stands as a complete listing; the invalid three are
        # never served, and they are counted in the observer.
        assert orders.snapshot(strict=True).identities() == ("a", "b")
        invalid = owner.observer().snapshot().connection("primary").invalid_records
        assert invalid >= 3 and invalid % 3 == 0
        # Each one is shown with its registry key in the observer.
        (service,) = owner.observer().snapshot().connection("primary").services
        assert {key for key, _reason in service.invalid_records} == {
            f"{head}/not-json",
            f"{head}/deleted-op",
            f"{head}/no-port",
        }
        # A new malformed record does not withdraw the good ones.
        await raw.put(f"{head}/huge", "x" * 70_000)
        await anyio.sleep(0.3)
        assert orders.snapshot(strict=True).identities() == ("a", "b")
        assert owner.observer().snapshot().connection("primary").invalid_records > invalid

        # Delete every key of the service in one request: the next change is
        # the explicit empty, refused for normal and strict reads alike.
        await raw.call(
            "/v3/kv/deleterange",
            {"key": raw.b64(f"{head}/"), "range_end": raw.b64(f"{head}0")},
        )
        await orders.changed(soon(2.0))
        for strict in (False, True):
            with pytest.raises(EvidenceUnavailable) as empty:
                orders.snapshot(strict=strict)
            assert empty.value.reason == "empty"
        # Candidates come back with the next complete listing.
        await raw.put_record(f"{head}/c", "10.0.0.4:8080")
        assert ids(await wait_for(orders, lambda a: ids(a) == {"c"}, 2.0)) == {"c"}
    assert all_tasks() == before


async def test_an_etcd_observation_drives_a_streaming_balance_end_to_end(
    etcd_server: EtcdServer, raw: RawEtcd
) -> None:
    prefix = unique_prefix()
    head = f"{prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:8080")
    sent_to: list[str] = []

    async def send(instance: Instance) -> httpx.Response:
        sent_to.append(instance.identity)
        return httpx.Response(200)

    def committed(route: Route) -> set[str]:
        return {str(e.key) for e in route.streaming.discovery.endpoints}

    before = all_tasks()
    async with open_discovery(
        etcd_config(etcd_server.url, prefix), prepare_deadline=soon()
    ) as owner:
        orders = await owner.client().observe("orders", soon())
        route = Route(orders, RestOptions())
        try:
            route.snapshot()
            await route.streaming.ready()
            assert committed(route) == {"a"}

            await raw.put_record(f"{head}/b", "10.0.0.2:8080")
            await orders.changed(soon(2.0))
            route.snapshot()
            await route.streaming.ready()
            assert committed(route) == {"a", "b"}
            for _ in range(4):
                response = await route.streaming.dispatch(Attempt(send=send))
                assert response.status_code == 200
            assert sorted(sent_to) == ["a", "a", "b", "b"]

            # A deleted instance leaves the pool with the next sync; nothing
            # more is sent to it.
            await raw.delete(f"{head}/a")
            await orders.changed(soon(2.0))
            route.snapshot()
            await route.streaming.ready()
            assert committed(route) == {"b"}
            sent_to.clear()
            for _ in range(3):
                await route.streaming.dispatch(Attempt(send=send))
            assert sent_to == ["b", "b", "b"]
        finally:
            route.close()
    assert all_tasks() == before
