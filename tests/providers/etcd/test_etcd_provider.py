"""Provider-level tests against a real etcd server (loopback, throw-away).

These run on real time: the server is real. Timeouts, TTLs and backoffs are
kept small so the module stays well under a minute.
"""

from __future__ import annotations

import base64
import json
import math
import socket
from typing import Any

import anyio
import httpx
import pytest
from nadisc_etcd import RecordError, decode_record_bytes

from nadisc import (
    CapacityRejected,
    DeadlineExceeded,
    EvidenceKind,
    HealthStatus,
    IdentityRevoked,
    IncompleteSnapshot,
    LeaseLost,
    LifecycleError,
    OutcomeUnknown,
    ProviderSnapshot,
    Registered,
    RegistrationError,
    RegistrationRecord,
)

from .conftest import EtcdServer, ProviderMaker, RawEtcd, RecordingSink, both_wires, make_context

pytestmark = pytest.mark.real_server


def soon(seconds: float = 3.0) -> float:
    return anyio.current_time() + seconds


def record(
    instance_id: str = "i-1", *, service: str = "orders", **fields: object
) -> RegistrationRecord:
    values: dict[str, object] = {
        "registration": "web",
        "service": service,
        "instance_id": instance_id,
        "host": "127.0.0.1",
        "port": 8080,
    }
    values.update(fields)
    return RegistrationRecord(**values)  # type: ignore[arg-type]


# ---------------------------------------------------------------- discovery


@both_wires
async def test_query_lists_records_in_grpc_layout(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server)
    head = f"{provider.settings.prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:8080")
    await raw.put_record(f"{head}/b", "[::1]:9090", {"weight": 3, "tags": ["x"], "zone": "z1"})
    await raw.put_record(f"{head}/c", "10.0.0.3:81", "opaque")
    # A sibling service whose name extends ours must not leak into the listing.
    await raw.put_record(f"{provider.settings.prefix}/orders-other/d", "10.0.0.4:1")

    snapshot = await provider.query("orders", soon())

    assert snapshot.service == "orders"
    assert snapshot.evidence is EvidenceKind.LEASE
    assert snapshot.identities() == ("a", "b", "c")
    a, b, c = snapshot.instances
    assert (a.host, a.port, a.weight, a.tags, dict(a.metadata)) == ("10.0.0.1", 8080, 1.0, (), {})
    assert (b.host, b.port, b.weight, b.tags, dict(b.metadata)) == (
        "::1",
        9090,
        3.0,
        ("x",),
        {"zone": "z1"},
    )
    assert dict(c.metadata) == {"Metadata": "opaque"}
    assert snapshot.invalid == {}


async def test_query_of_an_empty_service_is_a_complete_empty_listing(
    etcd_server: EtcdServer, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server)
    snapshot = await provider.query("nobody", soon())
    assert snapshot.instances == () and snapshot.invalid == {}


@both_wires
async def test_watch_sees_put_and_delete_within_one_round_trip(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server, probe_interval_ms=10_000)
    head = f"{provider.settings.prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:8080")
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        assert sink.ids() == {"a"}  # started() comes after the first complete listing

        # Each change is in the very next publish: one event, one round trip.
        changes = [
            (f"{head}/b", "10.0.0.2:8080", {"a": 8080, "b": 8080}),
            (f"{head}/b", "10.0.0.2:9999", {"a": 8080, "b": 9999}),
            (f"{head}/a", None, {"b": 9999}),
        ]
        for key, addr, expected in changes:
            before = len(sink.publishes)
            if addr is None:
                await raw.delete(key)
            else:
                await raw.put_record(key, addr)
            await sink.wait_for(lambda: len(sink.publishes) > before, 1.0)  # noqa: B023
            first = sink.publishes[before]
            assert {i.identity: i.port for i in first.instances} == expected
        nursery.cancel_scope.cancel()
    assert sink.failures == []
    stats = provider.statistics()
    assert (stats.watch_ranges, stats.watch_streams_opened) == (1, 1)


@both_wires
@pytest.mark.parametrize("mode", ["shared", "per_service"])
async def test_a_watch_opens_its_stream_from_now_before_its_first_range(
    etcd_server: EtcdServer,
    raw: RawEtcd,
    make_provider: ProviderMaker,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """etcd sends a watch from now every change as it commits, while a watch
    from a past revision waits for the server's resync (every 100 ms): the
    first change after a range used to take that long whenever it committed
    before the stream was created. So the stream is opened from now first,
    then the range is taken. A change committed in between is listed once
    (by the range; its event is ignored), a change after the range comes
    on the stream, and nothing is published twice."""
    provider = make_provider(etcd_server, probe_interval_ms=10_000, watch=mode)
    head = f"{provider.settings.prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:8080")
    client = provider._client
    calls: list[tuple[str, int]] = []
    real_watch, real_range = client.watch, client.range

    def watch(*args: Any, **kwargs: Any) -> Any:
        calls.append(("watch", kwargs["start_revision"]))
        return real_watch(*args, **kwargs)

    async def range_(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("keys_only") or kwargs.get("count_only"):
            return await real_range(*args, **kwargs)
        first = not any(kind == "range" for kind, _ in calls)
        if first:
            await raw.put_record(f"{head}/b", "10.0.0.2:8080")  # before the range
        answer = await real_range(*args, **kwargs)
        calls.append(("range", answer.header.revision))
        if first:
            await raw.put_record(f"{head}/c", "10.0.0.3:8080")  # after it
        return answer

    monkeypatch.setattr(client, "watch", watch)
    monkeypatch.setattr(client, "range", range_)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        assert sink.ids() == {"a", "b"}
        await sink.wait_for(lambda: "c" in sink.ids(), 5.0)
        assert [set(s.identities()) for s in sink.publishes] == [{"a", "b"}, {"a", "b", "c"}]
        nursery.cancel_scope.cancel()
    assert [kind for kind, _ in calls] == ["watch", "range"]
    assert calls[0] == ("watch", 0)  # from now, not from a past revision
    assert sink.failures == []
    stats = provider.statistics()
    assert (stats.watch_ranges, stats.watch_streams_opened) == (1, 1)


@both_wires
@pytest.mark.parametrize("mode", ["shared", "per_service"])
async def test_a_watch_takes_the_query_listing_read_at_its_stream_s_start(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker, mode: str
) -> None:
    """The owner queries a service, then starts its watch. When the stream
    (from now) is created at the very revision the query read, nothing
    changed in between: the watch starts from the query's listing instead of
    ranging again. A change in between makes it range."""
    provider = make_provider(etcd_server, probe_interval_ms=10_000, watch=mode)
    head = f"{provider.settings.prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:8080")
    queried = await provider.query("orders", soon())
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        assert sink.publishes[0] == queried
        stats = provider.statistics()
        assert (stats.watch_ranges, stats.watch_listings_taken) == (0, 1)
        await raw.put_record(f"{head}/b", "10.0.0.2:8080")
        await sink.wait_for(lambda: sink.ids() == {"a", "b"}, 5.0)
        nursery.cancel_scope.cancel()

    # Changed after the query (anywhere: the revision is the store's): ranged.
    await provider.query("orders", soon())
    await raw.put_record(f"{head}/c", "10.0.0.3:8080")
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        assert sink.ids() == {"a", "b", "c"}
        nursery.cancel_scope.cancel()
    stats = provider.statistics()
    assert (stats.watch_ranges, stats.watch_listings_taken) == (1, 1)
    assert sink.failures == []


@both_wires
@pytest.mark.parametrize("mode", ["shared", "per_service"])
async def test_a_watch_opened_while_the_query_runs_waits_for_it_and_takes_its_listing(
    etcd_server: EtcdServer,
    raw: RawEtcd,
    make_provider: ProviderMaker,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    """The owner starts a watch while the query before it is in flight
    (``Capabilities.watch_takes_query``). The watch's stream opens, then
    waits for that query: its range, answered after the stream was created
    and with nothing changed since, is the listing the watch starts from."""
    provider = make_provider(etcd_server, probe_interval_ms=10_000, watch=mode)
    assert provider.capabilities.watch_takes_query
    head = f"{provider.settings.prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:8080")
    client = provider._client
    real_range = client.range
    held = anyio.Event()
    release = anyio.Event()

    async def range_(*args: Any, **kwargs: Any) -> Any:
        if not held.is_set():  # the query's range waits until the stream is open
            held.set()
            await release.wait()
        return await real_range(*args, **kwargs)

    monkeypatch.setattr(client, "range", range_)
    queried: list[ProviderSnapshot] = []
    sink = RecordingSink()

    async def query() -> None:
        queried.append(await provider.query("orders", soon()))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as nursery:
            nursery.start_soon(query)
            await held.wait()

            async def watch() -> None:
                await provider.watch("orders", sink)

            nursery.start_soon(watch)
            while provider.statistics().watch_streams_opened == 0:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            await anyio.sleep(0.05)  # the watch now waits for the query
            assert sink.publishes == [] and sink.failures == []
            release.set()
            await sink.wait_for(lambda: len(sink.publishes) == 1, 5.0)
            assert sink.publishes[0] == queried[0]
            stats = provider.statistics()
            assert (stats.watch_ranges, stats.watch_listings_taken) == (0, 1)
            await raw.put_record(f"{head}/b", "10.0.0.2:8080")
            await sink.wait_for(lambda: sink.ids() == {"a", "b"}, 5.0)
            nursery.cancel_scope.cancel()
    assert sink.failures == []


async def test_idle_watch_is_confirmed_by_progress(
    etcd_server: EtcdServer, make_provider: ProviderMaker
) -> None:
    # Server progress notifications every second and probes every 300 ms both
    # confirm the listing without publishing it again.
    provider = make_provider(etcd_server)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "idle", sink)
        await sink.wait_for(lambda: sink.refreshes >= 2, 3.0)
        nursery.cancel_scope.cancel()
    assert len(sink.publishes) == 1 and sink.failures == []


@both_wires
async def test_progress_notifications_alone_confirm_an_idle_watch(
    etcd_server: EtcdServer, make_provider: ProviderMaker
) -> None:
    # Probes effectively off (one a minute): only the server's progress
    # notifications (every second in this fixture; etcd 3.4's default is
    # every 10 minutes) can confirm the idle listing.
    assert etcd_server.progress_notify == "1s"
    provider = make_provider(etcd_server, probe_interval_ms=60_000)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "idle", sink)
        await sink.wait_for(lambda: sink.refreshes >= 2, 3.5)
        nursery.cancel_scope.cancel()
    assert len(sink.publishes) == 1 and sink.failures == []
    assert provider.statistics().probes == 0


async def test_burst_of_1000_puts_converges_to_the_exact_newest_state(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server)
    head = f"{provider.settings.prefix}/burst"
    sink = RecordingSink()
    expected = {f"i{n:04d}" for n in range(1000) if n % 7}

    async def writer(worker: int) -> None:
        for n in range(worker, 1000, 20):
            await raw.put_record(f"{head}/i{n:04d}", f"10.1.{n // 250}.{n % 250 + 1}:80")
            if n % 7 == 0:
                await raw.delete(f"{head}/i{n:04d}")

    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "burst", sink)
        async with anyio.create_task_group() as writers:
            for worker in range(20):
                writers.start_soon(writer, worker)
        await sink.wait_for(lambda: sink.ids() == expected, 20.0)
        nursery.cancel_scope.cancel()
    final = await provider.query("burst", soon())
    assert final == sink.latest
    assert sink.latest.invalid == {}
    # At most one publish per received batch of events (plus the first listing);
    # events arriving together are published once.
    assert len(sink.publishes) <= 1 + 1000 + 143


@both_wires
async def test_malformed_records_are_invalid_and_the_valid_rest_stands(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server, max_record_bytes=256)
    head = f"{provider.settings.prefix}/orders"
    await raw.put_record(f"{head}/good", "10.0.0.1:80")
    await raw.put(f"{head}/not-json", "{nope")
    await raw.put(f"{head}/not-object", "[1, 2]")
    await raw.put(f"{head}/no-addr", json.dumps({"Op": 0}))
    await raw.put_record(f"{head}/no-port", "10.0.0.2")
    await raw.put(f"{head}/delete-op", json.dumps({"Op": 1, "Addr": "10.0.0.3:80"}))
    await raw.put_record(f"{head}/bad-weight", "10.0.0.4:80", {"weight": -1})
    await raw.put_record(f"{head}/too-big", "10.0.0.5:80", {"blob": "x" * 400})
    await raw.put(f"{head}/binary", b"\xff\xfe\x00")

    snapshot = await provider.query("orders", soon())

    assert snapshot.identities() == ("good",)
    invalid_ids = {key.rsplit("/", 1)[1] for key in snapshot.invalid}
    assert invalid_ids == {
        "not-json",
        "not-object",
        "no-addr",
        "no-port",
        "delete-op",
        "bad-weight",
        "too-big",
        "binary",
    }
    assert "max_record_bytes" in snapshot.invalid[f"{head}/too-big"]
    assert "port" in snapshot.invalid[f"{head}/no-port"]

    # The watch applies the same rule to events: a bad record joins ``invalid``,
    # fixing it moves it back among the instances.
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        assert sink.latest == snapshot
        await raw.put(f"{head}/good", "garbage")
        await sink.wait_for(lambda: sink.ids() == set(), 5.0)
        assert f"{head}/good" in sink.latest.invalid
        await raw.put_record(f"{head}/no-port", "10.0.0.2:8")
        await sink.wait_for(lambda: sink.ids() == {"no-port"}, 5.0)
        assert f"{head}/no-port" not in sink.latest.invalid
        nursery.cancel_scope.cancel()


@both_wires
async def test_bad_records_among_hundreds_of_good_ones_are_reported_by_key(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    """A range is decoded in bulk a chunk at a time; a chunk holding a bad
    record is decoded record by record: the bad ones are reported with the
    reason the record codec gives, every good one is listed."""
    provider = make_provider(etcd_server)
    head = f"{provider.settings.prefix}/orders"
    bad = {
        "i0007": b"{nope",
        "i0300": json.dumps({"Op": 1, "Addr": "10.9.9.9:80"}).encode(),
        "i0301": json.dumps({"Addr": "not a host:80"}).encode(),
        "i0599": b"",
    }
    limiter = anyio.CapacityLimiter(16)

    async def put(n: int) -> None:
        name = f"i{n:04d}"
        async with limiter:
            if name in bad:
                await raw.put(f"{head}/{name}", bad[name])
            else:
                await raw.put_record(
                    f"{head}/{name}", f"10.0.{n // 250}.{n % 250 + 1}:80", {"weight": n + 1}
                )

    async with anyio.create_task_group() as group:
        for n in range(600):
            group.start_soon(put, n)

    snapshot = await provider.query("orders", soon(10))

    assert snapshot.identities() == tuple(f"i{n:04d}" for n in range(600) if f"i{n:04d}" not in bad)
    assert [i.weight for i in snapshot.instances[:3]] == [1.0, 2.0, 3.0]
    reasons = {}
    for name, value in bad.items():
        with pytest.raises(RecordError) as refused:
            decode_record_bytes(name, value, max_record_bytes=provider.settings.max_record_bytes)
        reasons[f"{head}/{name}"] = str(refused.value)
    assert dict(snapshot.invalid) == reasons


@both_wires
async def test_a_record_over_the_byte_limit_is_invalid_not_a_failure(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    # (test_oversized_records.py has the whole story: paging, the owner.)
    provider = make_provider(etcd_server, context=make_context(max_response_bytes=2000))
    head = f"{provider.settings.prefix}/orders"
    await raw.put_record(f"{head}/thin", "10.0.0.2:80")
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        # One event larger than the limit: the stream refuses the message,
        # and the watch ranges again, where the record is refused alone.
        await raw.put_record(f"{head}/fat", "10.0.0.1:80", {"blob": "x" * 3000})
        await sink.wait_for(lambda: f"{head}/fat" in sink.latest.invalid, 2.0)
        nursery.cancel_scope.cancel()
    assert sink.failures == [] and sink.ids() == {"thin"}
    snapshot = await provider.query("orders", soon())
    assert snapshot.identities() == ("thin",)
    assert "max_response_bytes=2000" in snapshot.invalid[f"{head}/fat"]


async def test_more_instances_than_the_limit_is_capacity_rejected(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server, context=make_context(max_instances_per_service=2))
    head = f"{provider.settings.prefix}/orders"
    for n in range(3):
        await raw.put_record(f"{head}/i{n}", f"10.0.0.{n + 1}:80")
    with pytest.raises(CapacityRejected, match="max_instances_per_service=2"):
        await provider.query("orders", soon())


@both_wires
async def test_watch_reports_an_unreachable_server_and_still_starts(
    make_provider: ProviderMaker,
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    provider = make_provider(f"http://127.0.0.1:{port}")
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        assert sink.publishes == []
        assert isinstance(sink.failures[0], IncompleteSnapshot)
        await sink.wait_for(lambda: len(sink.failures) >= 2, 2.0)  # it keeps retrying
        nursery.cancel_scope.cancel()
    with pytest.raises(IncompleteSnapshot, match="no endpoint accepted"):
        await provider.query("orders", soon())
    # Nothing was sent: a write is known not to have applied (not OutcomeUnknown).
    with pytest.raises(IncompleteSnapshot, match="not sent"):
        await provider.register(record(), soon())
    with pytest.raises(IncompleteSnapshot, match="not sent"):
        await provider.renew(Registered(record(), "12345"), soon())


@both_wires
async def test_deadlines_are_checked_before_any_request(
    etcd_server: EtcdServer, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server)
    with pytest.raises(DeadlineExceeded):
        await provider.query("orders", anyio.current_time() - 1)
    with pytest.raises(DeadlineExceeded):
        await provider.register(record(), math.nan)
    assert provider.statistics().requests == 0


@both_wires
async def test_a_closed_provider_refuses_work(
    etcd_server: EtcdServer, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server)
    await provider.aclose()
    await provider.aclose()  # idempotent
    with pytest.raises(LifecycleError):
        await provider.query("orders", soon())


# ------------------------------------------------------------- registration


@both_wires
async def test_register_writes_a_grpc_compatible_record_on_a_lease(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server)
    mine = record(weight=2.5, tags=("blue",), metadata={"zone": "z1"})
    registered = await provider.register(mine, soon())

    [kv] = await raw.get(f"{provider.settings.prefix}/orders/i-1")
    assert int(kv["lease"]) == int(registered.handle)
    assert json.loads(base64.b64decode(kv["value"])) == {
        "Op": 0,
        "Addr": "127.0.0.1:8080",
        "Metadata": {"zone": "z1", "weight": 2.5, "tags": ["blue"]},
    }
    [instance] = (await provider.query("orders", soon())).instances
    assert (instance.identity, instance.weight, instance.tags) == ("i-1", 2.5, ("blue",))
    assert await provider.check(registered, soon()) is HealthStatus.HEALTHY
    assert await provider.renew(registered, soon()) == registered


@both_wires
async def test_deregister_revokes_the_lease_and_removes_the_key(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server)
    registered = await provider.register(record(), soon())
    await provider.deregister(registered, soon())
    assert await raw.get(f"{provider.settings.prefix}/orders/i-1") == []
    assert await provider.check(registered, soon()) is HealthStatus.MISSING
    with pytest.raises(LeaseLost):
        await provider.renew(registered, soon())
    await provider.deregister(registered, soon())  # already gone: harmless


async def test_deregister_leaves_a_record_someone_else_rewrote(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server)
    registered = await provider.register(record(), soon())
    key = f"{provider.settings.prefix}/orders/i-1"
    await raw.put_record(key, "127.0.0.1:9999")  # a newer process, no lease
    assert await provider.check(registered, soon()) is HealthStatus.MISSING
    await provider.deregister(registered, soon())
    [kv] = await raw.get(key)
    assert json.loads(base64.b64decode(kv["value"]))["Addr"] == "127.0.0.1:9999"


@both_wires
async def test_keepalive_on_a_revoked_lease_is_lease_lost(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    # 3 s TTL: keepalives due within 1 s, one covers the lease's renewals
    # for a quarter of that (the grant counts as one).
    provider = make_provider(etcd_server, ttl_seconds=3)
    registered = await provider.register(record(), soon())
    await provider.renew(registered, soon())  # just granted: nothing sent
    assert provider.statistics().keepalives == 0
    await raw.revoke(int(registered.handle))
    await anyio.sleep(0.3)
    with pytest.raises(LeaseLost, match="expired or was revoked"):
        await provider.renew(registered, soon())
    assert provider.statistics().keepalives == 1
    # the lease is known lost: no request, the same answer
    with pytest.raises(LeaseLost, match="expired or was revoked"):
        await provider.renew(registered, soon())
    assert provider.statistics().keepalives == 1
    assert await provider.check(registered, soon()) is HealthStatus.MISSING


async def provider_lease_ttl(server: EtcdServer, lease: int) -> int:
    """The seconds etcd says are left on ``lease`` (-1 once it is gone)."""
    async with httpx.AsyncClient(base_url=server.url, trust_env=False) as http:
        answer = await http.post("/v3/lease/timetolive", json={"ID": str(lease)})
    return int(answer.json().get("TTL", -1))


async def test_lease_lives_while_renewed_and_expires_when_keepalives_stop(
    etcd_server: EtcdServer, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server, ttl_seconds=2)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        registered = await provider.register(record(), soon())
        await sink.wait_for(lambda: sink.ids() == {"i-1"}, 5.0)
        for _ in range(6):  # 3 s of renewals outlive the 2 s TTL
            await anyio.sleep(0.5)
            await provider.renew(registered, soon())
        assert sink.ids() == {"i-1"}
        # The renewals kept the lease fresh: etcd itself (not our clock)
        # says more than half the TTL is left after the last one.
        answer = await provider_lease_ttl(etcd_server, int(registered.handle))
        assert answer >= 1
        # Measured 1-2 s (what was left of the TTL); the bound is 10x that.
        await sink.wait_for(lambda: sink.ids() == set(), 20.0)
        nursery.cancel_scope.cancel()
    assert await provider.check(registered, soon()) is HealthStatus.MISSING
    with pytest.raises(LeaseLost):
        await provider.renew(registered, soon())


async def test_invalid_registrations_are_refused_before_any_write(
    etcd_server: EtcdServer, make_provider: ProviderMaker
) -> None:
    provider = make_provider(etcd_server)
    with pytest.raises(RegistrationError, match="reserved"):
        await provider.register(record(metadata={"weight": "9"}), soon())
    with pytest.raises(RegistrationError, match="reachable"):
        await provider.register(record(host="0.0.0.0"), soon())
    with pytest.raises(RegistrationError, match="instance_id"):
        await provider.register(record("a/b"), soon())
    with pytest.raises(RegistrationError, match="lease id"):
        await provider.renew(Registered(record(), "not-a-lease"), soon())
    assert provider.statistics().requests == 0


# ------------------------------------------------------------------- faults


@both_wires
async def test_a_stopped_server_is_incomplete_then_recovers(
    own_etcd: EtcdServer, raw_factory, make_provider: ProviderMaker
) -> None:
    raw = raw_factory(own_etcd)
    provider = make_provider(own_etcd, context=make_context(request_timeout=0.5))
    head = f"{provider.settings.prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:80")
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        own_etcd.pause()
        try:
            await sink.wait_for(lambda: bool(sink.failures), 3.0)
            assert isinstance(sink.failures[0], IncompleteSnapshot)
            # Each call is bounded by the 0.5 s request_timeout (measured
            # 0.50 s each), not by its 10 s deadline: a bound of 12x.
            began = anyio.current_time()
            with pytest.raises(IncompleteSnapshot, match="deadline"):
                await provider.query("orders", soon(10))
            assert anyio.current_time() - began < 6.0
            began = anyio.current_time()
            with pytest.raises(OutcomeUnknown):
                await provider.register(record(), soon(10))
            assert anyio.current_time() - began < 6.0
            published = len(sink.publishes)
        finally:
            own_etcd.resume()
        # Recovery: a complete listing again, then changes flow as before.
        await sink.wait_for(lambda: len(sink.publishes) > published, 5.0)
        assert sink.ids() == {"a"}
        await raw.put_record(f"{head}/b", "10.0.0.2:80")
        await sink.wait_for(lambda: sink.ids() == {"a", "b"}, 2.0)
        nursery.cancel_scope.cancel()


@both_wires
async def test_watch_resumes_after_a_restart_without_losing_events(
    own_etcd: EtcdServer, raw_factory, make_provider: ProviderMaker
) -> None:
    raw = raw_factory(own_etcd)
    # A long backoff leaves a window after the restart in which we write
    # before the provider reconnects.
    provider = make_provider(
        own_etcd,
        retry_initial_backoff_ms=3000,
        retry_max_backoff_ms=3000,
        context=make_context(request_timeout=0.5),
    )
    head = f"{provider.settings.prefix}/orders"
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        await raw.put_record(f"{head}/a", "10.0.0.1:80")
        # Set-up: a first listing that timed out on a busy machine is retried
        # after the 3 s backoff; what follows counts from here.
        await sink.wait_for(lambda: sink.ids() == {"a"}, 8.0)
        failed, ranges = len(sink.failures), provider.statistics().watch_ranges

        own_etcd.kill()
        await sink.wait_for(lambda: len(sink.failures) > failed, 3.0)
        assert isinstance(sink.failures[failed], IncompleteSnapshot)
        own_etcd.start()
        # Events between the last revision seen and the reconnect...
        await raw.put_record(f"{head}/b", "10.0.0.2:80")
        await raw.delete(f"{head}/a")
        await sink.wait_for(lambda: sink.ids() == {"b"}, 6.0)
        # ...and right after it.
        await raw.put_record(f"{head}/c", "10.0.0.3:80")
        await sink.wait_for(lambda: sink.ids() == {"b", "c"}, 2.0)
        nursery.cancel_scope.cancel()
    stats = provider.statistics()
    assert stats.watch_ranges == ranges  # resumed from revision + 1, never re-ranged
    assert stats.watch_resumes >= 1 and stats.watch_streams_opened >= 2
    assert own_etcd.starts == 2


@both_wires
async def test_compacted_resume_revision_forces_a_fresh_range(
    own_etcd: EtcdServer, raw_factory, make_provider: ProviderMaker
) -> None:
    raw = raw_factory(own_etcd)
    provider = make_provider(
        own_etcd,
        retry_initial_backoff_ms=3000,
        retry_max_backoff_ms=3000,
        context=make_context(request_timeout=0.5),
    )
    head = f"{provider.settings.prefix}/orders"
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        await raw.put_record(f"{head}/a", "10.0.0.1:80")
        await sink.wait_for(lambda: sink.ids() == {"a"}, 8.0)  # as in the test above
        failed, ranges = len(sink.failures), provider.statistics().watch_ranges

        own_etcd.pause()  # the probe times out, the stream is abandoned
        await sink.wait_for(lambda: len(sink.failures) > failed, 3.0)
        own_etcd.resume()
        # While the provider backs off: change things and compact them away.
        await raw.put_record(f"{head}/b", "10.0.0.2:80")
        await raw.delete(f"{head}/a")
        await raw.put_record(f"{head}/c", "10.0.0.3:80")
        await raw.put_record(f"{head}/c", "10.0.0.3:81")
        await raw.compact(await raw.revision())

        await sink.wait_for(lambda: sink.ids() == {"b", "c"}, 6.0)
        assert sink.latest.instances[1].port == 81
        await raw.put_record(f"{head}/d", "10.0.0.4:80")
        await sink.wait_for(lambda: sink.ids() == {"b", "c", "d"}, 2.0)
        nursery.cancel_scope.cancel()
    stats = provider.statistics()
    assert (stats.compaction_resyncs, stats.watch_ranges - ranges) == (1, 1)


# --------------------------------------------------------------------- auth


@both_wires
async def test_auth_token_refresh_and_revoked_permission(
    own_etcd: EtcdServer, raw_factory, make_provider: ProviderMaker
) -> None:
    raw = raw_factory(own_etcd)
    prefix = "secured/services"
    start, end = b"secured/services/", b"secured/services0"
    for path, body in [
        ("/v3/auth/user/add", {"name": "root", "password": "root-pw"}),
        ("/v3/auth/role/add", {"name": "root"}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/user/add", {"name": "app", "password": "s3cret-app-pw"}),
        ("/v3/auth/role/add", {"name": "svc"}),
        (
            "/v3/auth/role/grant",
            {
                "name": "svc",
                "perm": {"permType": "READWRITE", "key": raw.b64(start), "range_end": raw.b64(end)},
            },
        ),
        ("/v3/auth/user/grant", {"user": "app", "role": "svc"}),
        ("/v3/auth/enable", {}),
    ]:
        await raw.call(path, body)

    # Authentication runs bcrypt on the server: tens of ms here, seconds on a
    # loaded machine, so requests get 5 s each instead of the usual 1 s.
    provider = make_provider(
        own_etcd,
        context=make_context(request_timeout=5.0),
        prefix=prefix,
        username="app",
        password="s3cret-app-pw",
        services={"orders": {"name": "orders"}},
    )
    assert "s3cret" not in repr(provider.settings) and "s3cret" not in repr(provider)
    await provider.prepare(soon(15))
    registered = await provider.register(record(), soon(15))
    assert (await provider.query("orders", soon(15))).identities() == ("i-1",)
    assert provider.statistics().authentications == 1

    # Wrong password: refused as a revoked identity, and the password stays secret.
    intruder = make_provider(own_etcd, prefix=prefix, username="app", password="wrong-pw")
    with pytest.raises(IdentityRevoked) as refused:
        await intruder.prepare(soon(15))
    assert "wrong-pw" not in str(refused.value)

    # Turning auth off and on again drops every token the server handed out:
    # ours is refused once and refreshed transparently.
    await raw.authenticate("root", "root-pw")
    await raw.call("/v3/auth/disable", {})
    raw.token = None
    await raw.call("/v3/auth/enable", {})
    assert await provider.check(registered, soon(15)) is HealthStatus.HEALTHY
    assert provider.statistics().authentications == 2

    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        assert sink.ids() == {"i-1"}
        await raw.authenticate("root", "root-pw")
        await raw.call(
            "/v3/auth/role/revoke",
            {"role": "svc", "key": raw.b64(start), "range_end": raw.b64(end)},
        )
        # etcd 3.4 keeps streaming to the old watcher; the probe notices.
        await sink.wait_for(lambda: any(isinstance(f, IdentityRevoked) for f in sink.failures))
        nursery.cancel_scope.cancel()
    with pytest.raises(IdentityRevoked, match="permission denied"):
        await provider.query("orders", soon(15))
    with pytest.raises(IdentityRevoked):
        await provider.prepare(soon(15))


@both_wires
async def test_checks_of_a_service_past_the_listing_limit_find_every_registration(
    etcd_server: EtcdServer, make_provider: ProviderMaker
) -> None:
    """Checks of many registrations in one service share one range of it; a
    range cut at max_instances_per_service + 1 records is not evidence that
    the keys after its last one are gone: each of those is read by itself."""
    provider = make_provider(etcd_server, context=make_context(max_instances_per_service=4))
    registered = [
        await provider.register(record(f"i-{n:02d}", registration=f"web-{n:02d}"), soon())
        for n in range(12)
    ]
    assert len({r.handle for r in registered}) == 1  # one shared lease: checks share a range
    health = [await provider.check(r, soon()) for r in registered]
    assert health == [HealthStatus.HEALTHY] * 12
    await provider.deregister(registered[-1], soon())
    assert await provider.check(registered[-1], soon()) is HealthStatus.MISSING
