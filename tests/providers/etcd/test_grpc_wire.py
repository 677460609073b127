"""The gRPC wire (``wire: grpc``) against the JSON gateway wire, on a real etcd.

Both clients are asked the same things of one server: they must give the
same answers and the same typed failures. The message table of
``nadisc_etcd._proto`` is checked against an independently generated copy of
etcd's protos (the ``*_pb2`` modules aetcd ships, generated from
etcd-io/etcd's ``rpc.proto`` and ``kv.proto``).
"""

from __future__ import annotations

import importlib
import socket
import sys
from collections.abc import AsyncIterator
from typing import cast

import anyio
import anyio.lowlevel
import httpx
import pytest
from google.protobuf.descriptor import FieldDescriptor
from nadisc_etcd import EtcdProvider, EtcdSettings
from nadisc_etcd._client import ClientCore, EtcdClient
from nadisc_etcd._grpc import EtcdGrpcClient, GrpcWatchStream
from nadisc_etcd._proto import MESSAGES
from nadisc_etcd._wire import RangeResponse, prefix_range_end

from nadisc import ConfigError, IncompleteSnapshot, LeaseLost, open_discovery
from tests.support_checkpoints import count_yields

from ...nadisc.owner_support import all_tasks
from .conftest import EtcdServer, RawEtcd, make_context
from .owner_helpers import etcd_config, unique_prefix

pytestmark = pytest.mark.real_server


def soon(seconds: float = 3.0) -> float:
    return anyio.current_time() + seconds


def settings(*endpoints: str, **values: object) -> EtcdSettings:
    return EtcdSettings.model_validate({"endpoints": list(endpoints), **values})


@pytest.fixture
async def both(etcd_server: EtcdServer) -> AsyncIterator[tuple[EtcdClient, EtcdGrpcClient]]:
    json_client = EtcdClient(
        settings(etcd_server.url), request_timeout=2.0, max_response_bytes=2**20
    )
    grpc_client = _client(etcd_server.url)
    yield json_client, grpc_client
    await json_client.aclose()
    await grpc_client.aclose()


def _pairs(answer: RangeResponse) -> list[tuple[bytes, int, int, int, int, bytes]]:
    return [
        (kv.key, kv.create_revision, kv.mod_revision, kv.version, kv.lease, kv.value_bytes())
        for kv in answer.kvs
    ]


def test_the_message_table_matches_etcd_s_generated_protos() -> None:
    # aetcd is a test dependency (pyproject's test extra): a missing one fails here.
    kv_pb2 = importlib.import_module("aetcd.rpc.kv_pb2")
    rpc_pb2 = importlib.import_module("aetcd.rpc.rpc_pb2")
    wire_types = {FieldDescriptor.TYPE_ENUM: FieldDescriptor.TYPE_INT64}  # both varints
    checked = 0
    for name, ours in MESSAGES.items():
        module = kv_pb2 if name in ("KeyValue", "Event") else rpc_pb2
        theirs = getattr(module, name).DESCRIPTOR
        assert ours.DESCRIPTOR.full_name == theirs.full_name
        for field in ours.DESCRIPTOR.fields:
            other = theirs.fields_by_name[field.name]
            assert field.number == other.number, (name, field.name)
            assert wire_types.get(field.type, field.type) == wire_types.get(
                other.type, other.type
            ), (name, field.name)
            assert field.is_repeated == other.is_repeated, (name, field.name)
            if field.message_type is not None:
                assert field.message_type.full_name == other.message_type.full_name
            checked += 1
    assert checked >= 70


async def test_both_wires_give_the_same_answers(
    both: tuple[EtcdClient, EtcdGrpcClient], etcd_server: EtcdServer
) -> None:
    json_client, grpc_client = both
    head = b"wires/answers/"
    end = prefix_range_end(head)
    grant = await grpc_client.lease_grant(30, deadline=soon())
    assert grant.ID > 0 and grant.TTL == 30 and grant.error == ""
    await grpc_client.put(head + b"a", b'{"Addr": "10.0.0.1:80"}', lease=grant.ID, deadline=soon())
    await json_client.put(head + b"b", b"\x00\xffbinary", lease=0, deadline=soon())
    put = await grpc_client.put(head + b"c", b"", lease=0, deadline=soon())
    by_json = await json_client.range(head, end, deadline=soon())
    by_grpc = await grpc_client.range(head, end, deadline=soon())
    assert by_grpc.header.revision == by_json.header.revision == put.header.revision
    assert _pairs(by_grpc) == _pairs(by_json)
    assert [p[-1] for p in _pairs(by_grpc)] == [b'{"Addr": "10.0.0.1:80"}', b"\x00\xffbinary", b""]
    # Options: limit, count only, keys only, newest first, at a revision.
    for options in (
        {"limit": 2},
        {"count_only": True},
        {"keys_only": True},
        {"limit": 1, "newest_first": True},
        {"revision": put.header.revision - 1},
    ):
        g = await grpc_client.range(head, end, deadline=soon(), **options)
        j = await json_client.range(head, end, deadline=soon(), **options)
        assert (_pairs(g), g.more, g.count) == (_pairs(j), j.more, j.count), options
    alive = await grpc_client.lease_time_to_live(grant.ID, deadline=soon())
    assert alive.ID == grant.ID and 0 < alive.TTL <= 30 and alive.grantedTTL == 30
    assert 0 < await grpc_client.lease_keepalive(grant.ID, deadline=soon()) <= 30
    assert not await grpc_client.delete_if_lease(head + b"b", grant.ID, deadline=soon())
    assert await grpc_client.delete_if_lease(head + b"a", grant.ID, deadline=soon())
    deleted = await grpc_client.delete_range(head, end, deadline=soon())
    assert deleted.deleted == 2
    assert await grpc_client.lease_revoke(grant.ID, deadline=soon())
    # A lease that is gone, the same on both wires.
    assert not await grpc_client.lease_revoke(grant.ID, deadline=soon())
    assert not await json_client.lease_revoke(grant.ID, deadline=soon())
    assert await grpc_client.lease_keepalive(grant.ID, deadline=soon()) == 0
    assert await json_client.lease_keepalive(grant.ID, deadline=soon()) == 0
    gone = await grpc_client.lease_time_to_live(grant.ID, deadline=soon())
    assert gone.TTL == (await json_client.lease_time_to_live(grant.ID, deadline=soon())).TTL == -1
    for client in (json_client, grpc_client):
        with pytest.raises(LeaseLost, match="lease not found"):
            await client.put(head + b"x", b"v", lease=grant.ID, deadline=soon())
    status = await grpc_client.status(deadline=soon())
    assert status.version == (await json_client.status(deadline=soon())).version != ""


async def test_a_watch_sees_the_same_events_and_a_compaction_the_same_way(
    both: tuple[EtcdClient, EtcdGrpcClient],
) -> None:
    json_client, grpc_client = both
    head = b"wires/watch/"
    end = prefix_range_end(head)
    first = await grpc_client.put(head + b"1", b"one", lease=0, deadline=soon())
    start = first.header.revision
    await grpc_client.put(head + b"2", b"two", lease=0, deadline=soon())
    await json_client.delete_range(head + b"1", deadline=soon())
    seen: dict[str, list[tuple[str, bytes, int]]] = {}
    for name, client in (("json", json_client), ("grpc", grpc_client)):
        events: list[tuple[str, bytes, int]] = []
        async with client.watch(head, end, start_revision=start, open_deadline=soon()) as stream:
            while len(events) < 3:
                for message in await stream.next_batch():
                    events += [(e.type, e.kv.key, e.kv.mod_revision) for e in message.events]
        seen[name] = events
    assert seen["grpc"] == seen["json"]
    assert [e[0] for e in seen["grpc"]] == ["PUT", "PUT", "DELETE"]
    # Compacted past the start revision: the first batch is the cancel
    # message with the compaction revision, not an error, on both wires.
    newest = (await grpc_client.put(head + b"3", b"three", lease=0, deadline=soon())).header
    await grpc_client.compact(newest.revision, deadline=soon())
    for client in (json_client, grpc_client):
        async with client.watch(head, end, start_revision=start, open_deadline=soon()) as stream:
            [cancel] = await stream.next_batch()
        assert cancel.canceled and cancel.compact_revision == newest.revision


async def test_a_watch_read_gives_the_loop_a_turn_even_with_messages_already_here(
    both: tuple[EtcdClient, EtcdGrpcClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The provider's watch reader relies on it: between two batches the
    # loop gets a turn, also while the server has more to say at once.
    json_client, grpc_client = both
    head = b"wires/turns/"
    end = prefix_range_end(head)
    me = {anyio.get_current_task().id}
    for client in (json_client, grpc_client):
        async with client.watch(head, end, start_revision=0, open_deadline=soon()) as stream:
            for n in range(3):
                await grpc_client.put(head + b"%d" % n, b"v", lease=0, deadline=soon())
            if isinstance(client, EtcdGrpcClient):
                call = cast(GrpcWatchStream, stream)._call
                for _ in range(500):  # the reader queues what the server sent
                    if call.has_response():
                        break
                    await anyio.sleep(0.01)
                assert call.has_response()
            events = 0
            with monkeypatch.context() as patch:
                taken = count_yields(patch, me)
                while events < 3:
                    before = len(taken)
                    buffered = isinstance(client, EtcdGrpcClient) and call.has_response()
                    batch = await stream.next_batch()
                    events += sum(len(message.events) for message in batch)
                    if isinstance(client, EtcdClient) or buffered:
                        # JSON: the chunks of one network read come without
                        # a turn; gRPC: a message already here is taken at once.
                        assert len(taken) == before + 1, client
        assert events == 3


def _dead_endpoint() -> str:
    """The URL of a loopback port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _client(*urls: str) -> EtcdGrpcClient:
    return EtcdGrpcClient(settings(*urls), request_timeout=2.0, max_response_bytes=2**20)


async def test_an_endpoint_that_refuses_connections_is_passed_over(
    etcd_server: EtcdServer,
) -> None:
    dead = _dead_endpoint()
    before = all_tasks()
    client = _client(dead, etcd_server.url)
    await client.put(b"wires/failover", b"v", lease=0, deadline=soon())
    assert client.endpoint == etcd_server.url
    alone = _client(dead)
    # Nothing reached a server: even a write is known not applied.
    with pytest.raises(IncompleteSnapshot, match="not sent, no endpoint accepted"):
        await alone.put(b"wires/failover", b"v", lease=0, deadline=soon())
    await client.aclose()
    await alone.aclose()
    await client.aclose()  # idempotent
    with pytest.raises(IncompleteSnapshot, match="closed"):
        await client.status(deadline=soon())
    assert all_tasks() == before


async def test_a_served_client_sends_its_calls_on_one_channel(etcd_server: EtcdServer) -> None:
    """While ``serve`` runs, unary calls are streams on its one channel; after
    it stops, each call opens a channel of its own again."""
    before = all_tasks()
    client = _client(etcd_server.url)
    async with anyio.create_task_group() as tg:
        await tg.start(client.serve)
        assert client._shared is not None
        for n in range(20):
            await client.put(b"served/k%02d" % n, b"v%d" % n, lease=0, deadline=soon())
        answer = await client.range(
            b"served/", prefix_range_end(b"served/"), limit=100, deadline=soon()
        )
        assert [kv.value_bytes() for kv in answer.kvs] == [b"v%d" % n for n in range(20)]
        assert client.counters.call_channels == 0
        tg.cancel_scope.cancel()
    assert client._shared is None
    await client.status(deadline=soon())
    assert client.counters.call_channels == 1
    await client.aclose()
    assert all_tasks() == before


async def test_the_served_channel_follows_a_failover(etcd_server: EtcdServer) -> None:
    """The first endpoint refuses connections: the first call passes over it
    (a channel of its own to the second), and the served channel moves to
    the second endpoint for the calls after it."""
    dead = _dead_endpoint()
    before = all_tasks()
    client = _client(dead, etcd_server.url)
    async with anyio.create_task_group() as tg:
        await tg.start(client.serve)
        assert client._shared is not None and client._shared[0] == 0
        await client.put(b"served/failover", b"v", lease=0, deadline=soon())
        assert client.endpoint == etcd_server.url
        assert client.counters.call_channels == 1
        with anyio.fail_after(5):
            while client._shared is None or client._shared[0] != 1:
                await anyio.lowlevel.checkpoint()
        for _ in range(5):
            await client.status(deadline=soon())
        assert client.counters.call_channels == 1
        tg.cancel_scope.cancel()
    await client.aclose()
    assert all_tasks() == before


async def test_under_an_owner_the_grpc_wire_keeps_one_channel_for_its_calls(
    etcd_server: EtcdServer, raw: RawEtcd
) -> None:
    prefix = unique_prefix()
    for n in range(3):
        await raw.put_record(f"{prefix}/orders/i{n}", f"10.0.0.{n + 1}:8080")
    before = all_tasks()
    config = etcd_config(etcd_server.url, prefix, etcd={"wire": "grpc"})
    async with open_discovery(config, prepare_deadline=soon()) as owner:
        provider = owner._connections["primary"].provider
        client = provider._client  # type: ignore[attr-defined]
        orders = await owner.client().observe("orders", soon())
        # The owner's serve task entered its channel at the owner's first
        # wait (prepare's); calls before that had channels of their own.
        assert client._shared is not None
        opened = client.counters.call_channels
        assert set(orders.snapshot().identities()) == {"i0", "i1", "i2"}
        for _ in range(10):
            listing = await provider.query("orders", soon())
            assert len(listing.instances) == 3
        # Every range, status and probe since went over the served channel.
        assert client.counters.call_channels == opened
    assert client._shared is None
    assert all_tasks() == before


def test_wire_grpc_without_the_grpc_extra_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "h2", None)  # what a missing module looks like
    with pytest.raises(ConfigError, match="grpc extra") as caught:
        EtcdProvider(make_context(name="main"), settings("http://127.0.0.1:2379", wire="grpc"))
    assert caught.value.path == "discovery.connections.main.etcd.wire"
    assert "h2" in str(caught.value)
    # The default wire needs none of it.
    provider = EtcdProvider(make_context(), settings("http://127.0.0.1:2379"))
    assert isinstance(provider._client, ClientCore)


def test_an_injected_http_transport_needs_the_json_wire() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(500))
    with pytest.raises(ConfigError, match="only be given with wire 'json'") as caught:
        EtcdProvider(
            make_context(), settings("http://127.0.0.1:2379", wire="grpc"), transport=transport
        )
    assert caught.value.path.endswith(".etcd.wire")


def test_an_unknown_wire_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="wire"):
        settings("http://127.0.0.1:2379", wire="http2")
