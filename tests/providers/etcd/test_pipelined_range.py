"""A complete range read in pipelined pages, against a real etcd.

The next page is asked for (in a child task of the range's own task group)
before the page just read is decoded, so etcd serves it meanwhile. These
tests pin the order of events by holding a page's answer back until the
page before it was decoded (the old, decode-at-the-end range never gets
there), never by the clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from nadisc_etcd import EtcdProvider
from nadisc_etcd import _provider as provider_module
from nadisc_etcd._state import ServiceState
from nadisc_etcd._wire import KeyValue, prefix_range_end

from nadisc import IncompleteSnapshot, ProviderFailure

from ...nadisc.owner_support import all_tasks
from .conftest import EtcdServer, ProviderMaker, RawEtcd, both_wires

pytestmark = pytest.mark.real_server

RECORDS = 40


def soon(seconds: float = 5.0) -> float:
    return anyio.current_time() + seconds


async def fill(raw: RawEtcd, head: str, records: int = RECORDS) -> None:
    for n in range(records):
        await raw.put_record(f"{head}/i{n:02d}", f"10.0.0.{n + 1}:80")


async def filled(
    make_provider: ProviderMaker, server: EtcdServer, raw: RawEtcd, **options: Any
) -> tuple[EtcdProvider, str, Any, Any]:
    """A provider of ``server`` whose service "orders" holds RECORDS records:
    (provider, the service's key prefix, its client, the client's real range)."""
    provider = make_provider(server, **options)
    head = f"{provider.settings.prefix}/orders"
    await fill(raw, head)
    client = provider._client
    return provider, head, client, client.range


class Journal:
    """What the range did, in order: ``("ask", start)`` when a page is asked
    for, ``("answer", first key)`` when its answer is handed to the range,
    ``("decode", first key)`` when a chunk of a page is decoded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, bytes]] = []
        self.decoded: set[bytes] = set()
        self._progress = anyio.Event()
        real = ServiceState._decode_all

        def decode_all(state: ServiceState, kvs: Sequence[KeyValue], keys: list[bytes]) -> Any:
            if keys:
                self.events.append(("decode", keys[0]))
                self.decoded.update(keys)
                self._progress.set()
                self._progress = anyio.Event()
            return real(state, kvs, keys)

        monkeypatch.setattr(ServiceState, "_decode_all", decode_all)

    async def decoded_through(self, key: bytes) -> None:
        """Wait until ``key``'s record was decoded (a deadlock guard, not a timing)."""
        with anyio.fail_after(5):
            while key not in self.decoded:
                await self._progress.wait()

    def index(self, event: tuple[str, bytes]) -> int:
        return self.events.index(event)


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of 10 keys on both wires: 40 records are four pages."""
    monkeypatch.setattr(provider_module, "PIPELINE_WIRES", frozenset({"json", "grpc"}))
    monkeypatch.setattr(provider_module, "PIPELINE_PAGE", 10)


@both_wires
@pytest.mark.usefixtures("small_pages")
async def test_a_paged_range_is_one_listing_at_the_first_pages_revision(
    etcd_server: EtcdServer,
    raw: RawEtcd,
    make_provider: ProviderMaker,
    monkeypatch: pytest.MonkeyPatch,
    wire: str,
) -> None:
    """Keys written, changed and deleted between the pages are not seen:
    every later page is read at the first page's revision."""
    provider, head, client, real = await filled(make_provider, etcd_server, raw)
    asked: list[tuple[int, int]] = []  # (limit, revision) of each page

    async def range_(*args: Any, **kwargs: Any) -> Any:
        asked.append((kwargs.get("limit", 0), kwargs.get("revision", 0)))
        answer = await real(*args, **kwargs)
        if len(asked) == 1:
            # After the first page, before the next is asked for.
            await raw.put_record(f"{head}/i99", "10.0.9.9:80")
            await raw.put_record(f"{head}/i30", "10.0.8.8:80")
            await raw.delete(f"{head}/i35")
        return answer

    monkeypatch.setattr(client, "range", range_)
    snapshot = await provider.query("orders", soon())
    ids = list(snapshot.identities())
    assert ids == [f"i{n:02d}" for n in range(RECORDS)]
    assert {i.identity: f"{i.host}:{i.port}" for i in snapshot.instances}["i30"] == "10.0.0.31:80"
    assert [limit for limit, _ in asked] == [10, 10, 10, 10]
    first = asked[1][1]
    assert first > 0 and all(revision == first for _, revision in asked[1:])
    assert asked[0][1] == 0
    # The next query sees the writes (the listing is not stuck).
    monkeypatch.setattr(client, "range", real)
    later = await provider.query("orders", soon())
    assert "i99" in later.identities() and "i35" not in later.identities()


@both_wires
@pytest.mark.usefixtures("small_pages")
async def test_the_next_page_is_asked_for_before_a_page_is_decoded(
    etcd_server: EtcdServer,
    raw: RawEtcd,
    make_provider: ProviderMaker,
    monkeypatch: pytest.MonkeyPatch,
    wire: str,
) -> None:
    """Page k+1 is asked for before page k is decoded, and its answer is
    only taken after page k was decoded: here each later page's answer is
    held back until the page before it was decoded (a range that decodes
    only once every page arrived waits for it forever)."""
    provider, head, client, real = await filled(make_provider, etcd_server, raw)
    journal = Journal(monkeypatch)
    starts: list[bytes] = []

    async def range_(start: bytes, *args: Any, **kwargs: Any) -> Any:
        journal.events.append(("ask", start))
        starts.append(start)
        answer = await real(start, *args, **kwargs)
        if start != head.encode() + b"/":
            await journal.decoded_through(start[:-1])  # the page before, decoded
        if answer.kvs:
            journal.events.append(("answer", answer.kvs[0].key))
        return answer

    monkeypatch.setattr(client, "range", range_)
    snapshot = await provider.query("orders", soon())
    assert len(snapshot.instances) == RECORDS
    assert len(starts) == 4
    pages = [
        [f"{head}/i{n:02d}".encode() for n in range(lo, lo + 10)] for lo in range(0, RECORDS, 10)
    ]
    for page, following in zip(pages, starts[1:], strict=False):
        assert following == page[-1] + b"\x00"
        # asked for before this page's decode began; answered after it
        assert journal.index(("ask", following)) < journal.index(("decode", page[0]))
    for page, later in itertools.pairwise(pages):
        assert journal.index(("decode", page[0])) < journal.index(("answer", later[0]))


@both_wires
@pytest.mark.usefixtures("small_pages")
async def test_a_cancelled_range_leaves_no_page_request_behind(
    etcd_server: EtcdServer,
    raw: RawEtcd,
    make_provider: ProviderMaker,
    monkeypatch: pytest.MonkeyPatch,
    wire: str,
) -> None:
    """Cancelled while the first page is decoded and the second is in
    flight: the query ends, and so does the request (its task belongs to
    the range's own task group); the provider is usable afterwards."""
    provider, head, client, real = await filled(make_provider, etcd_server, raw)
    journal = Journal(monkeypatch)
    in_flight = anyio.Event()
    ended: list[str] = []
    finished: list[object] = []

    async def range_(start: bytes, *args: Any, **kwargs: Any) -> Any:
        if start == head.encode() + b"/":
            return await real(start, *args, **kwargs)
        await journal.decoded_through(start[:-1])
        in_flight.set()
        try:
            await anyio.sleep_forever()
        finally:
            ended.append("cancelled")
        raise AssertionError("unreachable")  # pragma: no cover

    async def query() -> None:
        finished.append(await provider.query("orders", soon()))

    monkeypatch.setattr(client, "range", range_)
    before = all_tasks()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(query)
            await in_flight.wait()
            group.cancel_scope.cancel()
    # The request in flight was cancelled before the query returned, and
    # no task of the range (nor of a channel it held) is left.
    assert ended == ["cancelled"]
    assert all_tasks() == before
    assert finished == []
    assert "orders" not in provider._queried
    monkeypatch.setattr(client, "range", real)
    snapshot = await provider.query("orders", soon())
    assert len(snapshot.instances) == RECORDS


@both_wires
@pytest.mark.usefixtures("small_pages")
async def test_a_decode_failure_cancels_the_page_in_flight(
    etcd_server: EtcdServer,
    raw: RawEtcd,
    make_provider: ProviderMaker,
    monkeypatch: pytest.MonkeyPatch,
    wire: str,
) -> None:
    """An error while a page is decoded cancels the next page's request and
    is raised as it is (not wrapped in an exception group)."""
    provider, head, client, real = await filled(make_provider, etcd_server, raw)
    in_flight = anyio.Event()
    ended: list[str] = []
    real_decode = ServiceState._decode_all

    def decode_all(state: ServiceState, kvs: Sequence[KeyValue], keys: list[bytes]) -> Any:
        if in_flight.is_set():
            raise RuntimeError("decode broke")
        return real_decode(state, kvs, keys)

    async def range_(start: bytes, *args: Any, **kwargs: Any) -> Any:
        if start == head.encode() + b"/":
            return await real(start, *args, **kwargs)
        in_flight.set()
        try:
            await anyio.sleep_forever()
        finally:
            ended.append("cancelled")
        raise AssertionError("unreachable")  # pragma: no cover

    monkeypatch.setattr(client, "range", range_)
    monkeypatch.setattr(ServiceState, "_decode_all", decode_all)
    with anyio.fail_after(10), pytest.raises(RuntimeError, match="decode broke"):
        await provider.query("orders", soon())
    assert ended == ["cancelled"]


@both_wires
@pytest.mark.usefixtures("small_pages")
async def test_a_failure_of_the_page_in_flight_is_raised_as_that_requests(
    own_etcd: EtcdServer,
    raw_factory: Any,
    make_provider: ProviderMaker,
    monkeypatch: pytest.MonkeyPatch,
    wire: str,
) -> None:
    """The second page, asked for while the first is decoded, fails (its
    revision was compacted away meanwhile): the query raises what that
    request raises by itself, not an exception group, and keeps nothing."""
    raw = raw_factory(own_etcd)
    provider, head, client, real = await filled(make_provider, own_etcd, raw)
    journal = Journal(monkeypatch)
    revisions: list[int] = []

    async def range_(start: bytes, *args: Any, **kwargs: Any) -> Any:
        if start == head.encode() + b"/":
            answer = await real(start, *args, **kwargs)
            revisions.append(answer.header.revision)
            # The first page's revision is compacted away before the next page.
            await raw.put_record(f"{head}/i99", "10.0.9.9:80")
            await raw.compact(await raw.revision())
            return answer
        await journal.decoded_through(f"{head}/i00".encode())  # the first page, decoded
        return await real(start, *args, **kwargs)

    monkeypatch.setattr(client, "range", range_)
    with anyio.fail_after(10), pytest.raises(ProviderFailure) as caught:
        await provider.query("orders", soon())
    monkeypatch.setattr(client, "range", real)
    start = f"{head}/i04".encode()
    with pytest.raises(ProviderFailure) as alone:
        await client.range(
            start,
            prefix_range_end(f"{head}/".encode()),
            limit=8,
            revision=revisions[0],
            deadline=soon(),
        )
    assert type(caught.value) is type(alone.value)
    assert isinstance(caught.value, IncompleteSnapshot)
    assert str(caught.value) == str(alone.value)
    assert "orders" not in provider._queried


@both_wires
async def test_only_the_grpc_wire_splits_a_listing_that_fits_one_page(
    etcd_server: EtcdServer,
    raw: RawEtcd,
    make_provider: ProviderMaker,
    monkeypatch: pytest.MonkeyPatch,
    wire: str,
) -> None:
    """A listing over ``PIPELINE_PAGE`` keys that fits the page budget: pages
    on ``grpc`` (etcd serves the next while one is decoded), one request on
    the JSON gateway (whose serving costs etcd several times our decode)."""
    monkeypatch.setattr(provider_module, "PIPELINE_PAGE", 16)
    provider, _, client, real = await filled(make_provider, etcd_server, raw)
    limits: list[int] = []

    async def range_(*args: Any, **kwargs: Any) -> Any:
        limits.append(kwargs.get("limit", 0))
        return await real(*args, **kwargs)

    monkeypatch.setattr(client, "range", range_)
    snapshot = await provider.query("orders", soon())
    assert len(snapshot.instances) == RECORDS
    assert limits == ([16, 16, 16] if wire == "grpc" else [2048])  # the budget: 2 MiB at 1 KiB


@pytest.mark.usefixtures("small_pages")
async def test_the_pages_of_a_range_share_one_grpc_channel(
    etcd_server: EtcdServer, raw: RawEtcd, make_provider: ProviderMaker
) -> None:
    """Without a served channel (no owner) a call opens a channel of its
    own; the pages of one range share one, held by the range."""
    provider, _, client, _ = await filled(make_provider, etcd_server, raw, wire="grpc")
    before = all_tasks()
    opened = client.counters.call_channels
    requests = client.counters.requests
    snapshot = await provider.query("orders", soon())
    assert len(snapshot.instances) == RECORDS
    assert client.counters.requests - requests == 4
    assert client.counters.call_channels - opened == 1
    assert all_tasks() == before
