"""A record too large for the response limit is one invalid record, not a
failed service.

The owner's ``limits.max_snapshot_bytes`` is the etcd provider's
``max_response_bytes``: no response body (or watch message) larger than it
is read. Set below etcd's own request limit (1.5 MiB by default), one value
can be larger than any response may be. That record is listed invalid, with
a reason naming the limit and never the value, and every other record of
the service is still served, as with the default limit (where the same
value is invalid as longer than ``max_record_bytes``). Only what the limit
cannot hold at all (not even one key) stays ``CapacityRejected``, and a
listing whose valid records together exceed ``max_snapshot_bytes`` is
still withheld by the owner's capacity ledger.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest
from nadisc_etcd import EtcdProvider, EtcdSettings
from nadisc_etcd._state import ProbeVerdict
from nadisc_etcd._wire import KeyValue

from nadisc import CapacityRejected, HealthStatus, RegistrationRecord, open_discovery

from ...nadisc.owner_support import all_tasks
from .conftest import EtcdServer, ProviderMaker, RawEtcd, RecordingSink, both_wires, make_context
from .owner_helpers import etcd_config, ids, look, reason, soon, unique_prefix, wait_for

LIMIT = 64 * 1024
#: Far over LIMIT, well under etcd's 1.5 MiB request limit.
BLOB = "x" * 200_000


def big_reason_ok(text: str) -> bool:
    """The reason names the limit and quotes nothing of the value."""
    return f"max_response_bytes={LIMIT}" in text and "xxxx" not in text


# ------------------------------------------------------------ real etcd


@pytest.mark.real_server
@both_wires
@pytest.mark.parametrize("watch", ["shared", "per_service"])
async def test_a_record_larger_than_the_response_limit_is_invalid_and_the_rest_stands(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker, watch: str
) -> None:
    provider = make_provider(
        etcd_server, context=make_context(max_response_bytes=LIMIT), watch=watch
    )
    head = f"{provider.settings.prefix}/orders"
    good = tuple(f"i{n:02d}" for n in range(40))
    for n, name in enumerate(good):
        await raw.put_record(f"{head}/{name}", f"10.0.0.{n + 1}:80")
    await raw.put_record(f"{head}/i17-big", "10.0.1.1:80", {"blob": BLOB})

    snapshot = await provider.query("orders", soon())
    assert snapshot.identities() == good
    assert list(snapshot.invalid) == [f"{head}/i17-big"]
    assert big_reason_ok(snapshot.invalid[f"{head}/i17-big"])

    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        assert sink.latest.identities() == good
        assert list(sink.latest.invalid) == [f"{head}/i17-big"]
        # Written while watched: the watch message is over the limit too.
        await raw.put_record(f"{head}/i31-big", "10.0.1.2:80", {"blob": BLOB})
        await sink.wait_for(lambda: f"{head}/i31-big" in sink.latest.invalid)
        assert sink.latest.identities() == good
        assert big_reason_ok(sink.latest.invalid[f"{head}/i31-big"])
        # Later changes are followed as usual: the stream goes on.
        await raw.put_record(f"{head}/i17-big", "10.0.1.1:80")
        await raw.delete(f"{head}/i00")
        await sink.wait_for(lambda: "i17-big" in sink.ids() and "i00" not in sink.ids())
        assert list(sink.latest.invalid) == [f"{head}/i31-big"]
        nursery.cancel_scope.cancel()
    assert sink.failures == []
    stats = provider.statistics()
    assert stats.oversized_resyncs >= 1 and stats.watch_failures == 0


@pytest.mark.real_server
@both_wires
async def test_a_limit_that_holds_no_response_at_all_is_capacity_rejected(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    # 20 bytes hold no answer of etcd's (a header alone is larger): the
    # listing cannot be read, and nothing is mistaken for an invalid record.
    provider = make_provider(etcd_server, context=make_context(max_response_bytes=20))
    head = f"{provider.settings.prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:80")
    # (The gRPC channel refuses even the request: its send limit is the same.)
    with pytest.raises(CapacityRejected, match=r"max_response_bytes=20|20-byte"):
        await provider.query("orders", soon())
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        await sink.wait_for(lambda: len(sink.failures) >= 2)
        nursery.cancel_scope.cancel()
    assert sink.publishes == []
    assert all(isinstance(failure, CapacityRejected) for failure in sink.failures)


@pytest.mark.real_server
@both_wires
async def test_the_owner_serves_the_rest_and_withholds_only_a_listing_over_the_limit(
    etcd_server: EtcdServer, raw: RawEtcd
) -> None:
    prefix = unique_prefix()
    head = f"{prefix}/orders"
    for n in range(3):
        await raw.put_record(f"{head}/i{n}", f"10.0.0.{n + 1}:8080")
    await raw.put_record(f"{head}/i1-big", "10.0.9.9:8080", {"blob": BLOB})
    config = etcd_config(etcd_server.url, prefix, limits={"max_snapshot_bytes": LIMIT})
    before = all_tasks()
    async with open_discovery(config, prepare_deadline=soon()) as owner:
        orders = await owner.client().observe("orders", soon())
        assert orders.snapshot(strict=True).identities() == ("i0", "i1", "i2")

        def metrics() -> Any:
            return owner.observer().snapshot().connection("primary")

        assert (metrics().invalid_records, metrics().capacity_rejections) == (1, 0)
        (service,) = metrics().services
        (key, why), *_ = service.invalid_records
        assert key == f"{head}/i1-big" and big_reason_ok(why)

        # One more written while watched: still only that record is refused.
        await raw.put_record(f"{head}/i2-big", "10.0.9.8:8080", {"blob": BLOB})
        await raw.put_record(f"{head}/i3", "10.0.0.4:8080")
        await wait_for(orders, lambda answer: ids(answer) == {"i0", "i1", "i2", "i3"})
        assert orders.snapshot(strict=True).identities() == ("i0", "i1", "i2", "i3")
        assert (metrics().invalid_records, metrics().capacity_rejections) == (2, 0)

        # Valid records that together exceed max_snapshot_bytes: the listing
        # is withheld by the owner's ledger (a capacity rejection).
        await raw.call(
            "/v3/kv/txn",
            {
                "success": [
                    {
                        "request_put": {
                            "key": raw.b64(f"{head}/pad{n:03d}"),
                            "value": raw.b64(
                                json.dumps(
                                    {
                                        "Op": 0,
                                        "Addr": f"10.0.2.{n + 1}:8080",
                                        "Metadata": {"pad": "p" * 1000},
                                    }
                                )
                            ),
                        }
                    }
                    for n in range(80)
                ]
            },
        )
        answer = await wait_for(orders, lambda answer: reason(answer) == "capacity")
        assert ids(answer) is None and reason(look(orders, strict=True)) == "capacity"
        assert metrics().capacity_rejections >= 1
    assert all_tasks() == before


@pytest.mark.real_server
@both_wires
async def test_registration_checks_read_their_own_keys_past_an_oversized_record(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    """Checks of many registrations on one lease share one range of their
    service; when that range is over the limit (someone else's record too
    large for any response), each check reads its own key instead of
    failing."""
    provider = make_provider(etcd_server, context=make_context(max_response_bytes=LIMIT))
    registered = [
        await provider.register(
            RegistrationRecord(
                registration=f"web-{n:02d}",
                service="orders",
                instance_id=f"i-{n:02d}",
                host="127.0.0.1",
                port=8080,
            ),
            soon(),
        )
        for n in range(10)
    ]
    assert len({r.handle for r in registered}) == 1  # one shared lease: checks share a range
    await raw.put_record(f"{provider.settings.prefix}/orders/i-05-big", "10.0.9.9:80", {"b": BLOB})
    health = [await provider.check(r, soon()) for r in registered]
    assert health == [HealthStatus.HEALTHY] * 10
    await provider.deregister(registered[3], soon())
    assert await provider.check(registered[3], soon()) is HealthStatus.MISSING


# ------------------------------------------------------- range paging


class PagedServer:
    """``/v3/kv/range`` as etcd answers it, over a fixed key set at one
    revision: ``limit``, ``keys_only`` and ``count_only`` honoured, ``more``
    and ``count`` of the whole range. Records how each request was asked
    and how large its answer was."""

    def __init__(
        self, records: dict[bytes, bytes], *, refuse: Callable[[], httpx.Response] | None = None
    ) -> None:
        self.records = dict(sorted(records.items()))
        self.refuse = refuse
        self.asked: list[dict[str, Any]] = []
        self.sizes: list[int] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v3/kv/range"
        body = json.loads(request.content)
        self.asked.append(body)
        if self.refuse is not None:
            return self.refuse()
        start = base64.b64decode(body["key"])
        end = base64.b64decode(body["range_end"])
        limit = int(body.get("limit", 0))
        keys = [k for k in self.records if start <= k < end]
        page = keys[:limit] if limit else keys
        payload: dict[str, Any] = {"header": {"revision": "9"}, "count": str(len(keys))}
        if not body.get("count_only"):
            payload["kvs"] = [
                {"key": b64(k), "mod_revision": "7"}
                | ({} if body.get("keys_only") else {"value": b64(self.records[k])})
                for k in page
            ]
            payload["more"] = len(page) < len(keys)
        data = json.dumps(payload).encode()
        self.sizes.append(len(data))
        return streamed(200, data)


def streamed(status: int, data: bytes) -> httpx.Response:
    """A response whose body is read as a stream (no declared length)."""
    return httpx.Response(status, stream=httpx.ByteStream(data))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def paged_provider(server: PagedServer, limit: int) -> EtcdProvider:
    return EtcdProvider(
        make_context(max_response_bytes=limit),
        EtcdSettings.model_validate({"endpoints": ["http://a:1"], "prefix": "p"}),
        transport=httpx.MockTransport(server.handle),
    )


def small(n: int) -> bytes:
    return json.dumps({"Op": 0, "Addr": f"10.1.{n // 250}.{n % 250 + 1}:80"}).encode()


def big(n: int) -> bytes:
    return json.dumps(
        {"Op": 0, "Addr": f"10.2.0.{n}:80", "Metadata": {"b": "x" * 100_000}}
    ).encode()


@pytest.mark.parametrize("where", [0, 150, 299])
async def test_an_oversized_record_costs_a_bounded_number_of_requests(where: int) -> None:
    records = {f"p/orders/i{n:04d}".encode(): small(n) for n in range(300)}
    records[f"p/orders/i{where:04d}".encode()] = big(1)
    server = PagedServer(records)
    provider = paged_provider(server, LIMIT)
    snapshot = await provider.query("orders", anyio.current_time() + 5)
    assert len(snapshot.instances) == 299
    assert list(snapshot.invalid) == [f"p/orders/i{where:04d}"]
    assert big_reason_ok(snapshot.invalid[f"p/orders/i{where:04d}"])
    # One listing: once a request told the revision (the first page, or
    # when that was refused, a count-only range), every later one reads it.
    revisions = [body.get("revision") for body in server.asked]
    told = revisions.index("9")
    assert told <= 2 and set(revisions[:told]) == {None} and set(revisions[told:]) == {"9"}
    # The record is named by a keys-only read; pages shrink a quarter at a
    # time around it (never growing back into it): a handful of requests.
    assert sum(1 for body in server.asked if body.get("keys_only")) == 1
    refused = sum(1 for size in server.sizes if size > LIMIT)
    assert refused <= 6
    assert len(server.asked) <= 30
    await provider.aclose()


async def test_two_oversized_neighbours_are_each_invalid() -> None:
    records = {f"p/orders/i{n:04d}".encode(): small(n) for n in range(50)}
    records[b"p/orders/i0020"] = big(1)
    records[b"p/orders/i0021"] = big(2)
    provider = paged_provider(PagedServer(records), LIMIT)
    snapshot = await provider.query("orders", anyio.current_time() + 5)
    assert len(snapshot.instances) == 48
    assert list(snapshot.invalid) == ["p/orders/i0020", "p/orders/i0021"]
    # Each is kept at its mod_revision: a probe's keys-only listing of the
    # same records confirms the state (it would otherwise lag, then stall).
    state = provider._queried["orders"]
    keys = [KeyValue(key=key, mod_revision=7) for key in sorted(records)]
    assert state.judge_probe(9, keys) is ProbeVerdict.CONFIRMED
    await provider.aclose()


async def test_a_refusal_by_the_server_is_not_taken_for_an_oversized_record() -> None:
    # etcd's "too many requests" is RESOURCE_EXHAUSTED as well: no smaller
    # pages, no record marked invalid, one request.
    def refusal() -> httpx.Response:
        body = {"error": "etcdserver: too many requests", "code": 8}
        return streamed(429, json.dumps(body).encode())

    server = PagedServer({b"p/orders/a": small(1)}, refuse=refusal)
    provider = paged_provider(server, LIMIT)
    with pytest.raises(CapacityRejected, match="too many requests"):
        await provider.query("orders", anyio.current_time() + 5)
    assert len(server.asked) == 1
    await provider.aclose()
