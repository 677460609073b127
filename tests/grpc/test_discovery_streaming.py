"""Streaming calls through discovery: moved to another instance when the server never saw
them, and the call object of a plain channel's streaming call (details(), write()).

The rule is the unary calls' one: an attempt the server never saw (a refused
connection, REFUSED_STREAM, a stream above a GOAWAY's last stream id) goes to
another instance within the call's deadline, at most once per listed
instance, while no response was delivered, no write() went through, and no
request was taken from an iterator that cannot be replayed (a list or a
tuple can). The instance that refused it is charged as a unary call charges
it (a ``transport`` failure of the route, and a failed load guard).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from types import ModuleType
from typing import Any

import grpc
import h2.errors
import h2.events
import pytest

from nadisc import Instance
from nadisc.grpc import RpcError
from tests.grpc.conftest import Opener
from tests.grpc.discovery_support import backends
from tests.grpc.support import Conn, h2_server
from tests.grpc.test_discovery_calls import PLAIN, closed_port, goaway_below, refuse

PAYLOADS = (b"p1", b"p2", b"p3")


def requests(pb: ModuleType) -> list[Any]:
    return [pb.StreamingOutputCallRequest(payload=pb.Payload(body=p)) for p in PAYLOADS]


async def unary_stream(pb: ModuleType, stub: Any) -> list[bytes]:
    request = pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters()] * 2)
    return [m.payload.body async for m in stub.StreamingOutputCall(request, timeout=10)]


async def bidi_list(pb: ModuleType, stub: Any) -> list[bytes]:
    return [m.payload.body async for m in stub.FullDuplexCall(requests(pb), timeout=10)]


async def bidi_iter(pb: ModuleType, stub: Any) -> list[bytes]:
    call = stub.FullDuplexCall(iter(requests(pb)), timeout=10)
    return [m.payload.body async for m in call]


async def bidi_async(pb: ModuleType, stub: Any) -> list[bytes]:
    async def gen() -> AsyncIterator[Any]:
        for request in requests(pb):
            yield request

    return [m.payload.body async for m in stub.FullDuplexCall(gen(), timeout=10)]


async def bidi_write(pb: ModuleType, stub: Any) -> list[bytes]:
    call = stub.FullDuplexCall(timeout=10)
    for request in requests(pb):
        await call.write(request)
    await call.done_writing()
    return [m.payload.body async for m in call]


async def client_write(pb: ModuleType, stub: Any) -> list[bytes]:
    call = stub.StreamingInputCall(timeout=10)
    for body in PAYLOADS:
        await call.write(pb.StreamingInputCallRequest(payload=pb.Payload(body=body)))
    await call.done_writing()
    response = await call
    assert await call.code() == grpc.StatusCode.OK
    assert await call.details() == ""
    return [str(response.aggregated_payload_size).encode()]


Kind = Callable[[ModuleType, Any], Awaitable[list[bytes]]]

EXPECTED: dict[Kind, list[bytes]] = {
    unary_stream: [b"b0", b"b0"],
    bidi_list: [b"b0:" + p for p in PAYLOADS],
    bidi_iter: [b"b0:" + p for p in PAYLOADS],
    bidi_async: [b"b0:" + p for p in PAYLOADS],
    bidi_write: [b"b0:" + p for p in PAYLOADS],
    client_write: [str(sum(len(p) for p in PAYLOADS)).encode()],
}


def assert_charged_like_unary(channel: Any, bad: str) -> None:
    """Every pick of ``bad`` failed, each counted once as a ``transport`` failure."""
    stats = channel.route.statistics()
    assert stats.sent[bad] >= 1  # the bad instance was picked
    assert stats.failed == {bad: stats.sent[bad]}
    assert stats.failures["transport"] == stats.sent[bad]
    assert stats.failures["status"] == 0


@pytest.mark.parametrize("kind", list(EXPECTED), ids=lambda kind: kind.__name__)
async def test_a_stream_to_a_dead_port_goes_to_another_instance(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType, kind: Kind
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        dead = Instance("dead", "127.0.0.1", closed_port(), metadata=PLAIN)
        async with discovery(dead, servers[0].instance()) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            for _ in range(4):
                assert await kind(pb, stub) == EXPECTED[kind]
            assert_charged_like_unary(channel, "dead")
            assert channel.stats.codes[grpc.StatusCode.OK.value[0]] == 4
        assert servers[0].calls == 4
        if kind is not unary_stream:
            assert servers[0].received == list(PAYLOADS) * 4  # every request, once, in order


@pytest.mark.parametrize("scenario", [refuse, goaway_below], ids=["refused", "goaway"])
@pytest.mark.parametrize("kind", [unary_stream, bidi_list], ids=lambda kind: kind.__name__)
async def test_a_stream_the_server_never_saw_goes_to_another_instance(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType, scenario: Any, kind: Kind
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with h2_server(scenario) as bad:
            bad_one = Instance("bad", "127.0.0.1", bad.port, metadata=PLAIN)
            async with discovery(bad_one, servers[0].instance()) as (_owner, channel, _memory):
                stub = pb_grpc.TestServiceStub(channel)
                for _ in range(4):
                    assert await kind(pb, stub) == EXPECTED[kind]
                assert_charged_like_unary(channel, "bad")
                picked = channel.route.statistics().sent["bad"]
            # The subchannel never re-sends on its own: one stream per pick.
            assert len(bad.record.requests) == picked
        assert servers[0].calls == 4


async def test_with_every_instance_tried_one_more_round_then_unavailable(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    async with h2_server(refuse) as bad:
        bad_one = Instance("bad", "127.0.0.1", bad.port, metadata=PLAIN)
        async with discovery(bad_one) as (_owner, channel, _memory):
            with pytest.raises(RpcError) as info:
                await unary_stream(pb, pb_grpc.TestServiceStub(channel))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # As a unary call: the first attempt and one transparent retry.
            assert channel.route.statistics().sent == {"bad": 2}
            assert channel.route.statistics().failures["transport"] == 2
        assert len(bad.record.requests) == 2


async def refuse_after_data(conn: Conn, event: h2.events.Event) -> None:
    """Refuse a stream once its first request message arrived (so it was taken)."""
    key = f"refused {getattr(event, 'stream_id', 0)}"
    if isinstance(event, h2.events.DataReceived) and event.stream_id and key not in conn.state:
        conn.state[key] = True
        conn.h2.reset_stream(event.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)


async def test_a_request_taken_from_a_one_shot_iterator_pins_the_call(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    taken: list[int] = []

    def one_shot() -> Any:
        for i, request in enumerate(requests(pb)):
            taken.append(i)
            yield request

    async with h2_server(refuse_after_data) as bad:
        bad_one = Instance("bad", "127.0.0.1", bad.port, metadata=PLAIN)
        async with discovery(bad_one) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            with pytest.raises(RpcError) as info:
                async for _ in stub.FullDuplexCall(one_shot(), timeout=10):
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert taken  # a request was taken: it cannot be asked for again
            # Not re-sent (one listed instance would get one more try otherwise),
            # and charged once.
            stats = channel.route.statistics()
            assert stats.sent == {"bad": 1} and stats.failed == {"bad": 1}
        assert len(bad.record.requests) == 1


async def test_a_list_of_requests_is_replayed_whole_to_the_next_instance(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with h2_server(refuse_after_data) as bad:
            bad_one = Instance("bad", "127.0.0.1", bad.port, metadata=PLAIN)
            async with discovery(bad_one, servers[0].instance()) as (_owner, channel, _memory):
                stub = pb_grpc.TestServiceStub(channel)
                for _ in range(2):
                    assert await bidi_list(pb, stub) == EXPECTED[bidi_list]
                assert_charged_like_unary(channel, "bad")
            assert bad.record.data  # the refused stream had taken requests
        assert servers[0].received == list(PAYLOADS) * 2


async def test_a_delivered_response_pins_the_call(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    message = pb.StreamingOutputCallResponse(payload=pb.Payload(body=b"bad")).SerializeToString()

    async def one_then_refuse(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived) and event.stream_id:
            await conn.respond(event.stream_id)
            frame = b"\0" + len(message).to_bytes(4, "big") + message
            await conn.data(event.stream_id, frame)
            conn.h2.reset_stream(event.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)

    async with h2_server(one_then_refuse) as bad:
        bad_one = Instance("bad", "127.0.0.1", bad.port, metadata=PLAIN)
        async with discovery(bad_one) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            got = []
            with pytest.raises(RpcError) as info:
                async for response in stub.StreamingOutputCall(
                    pb.StreamingOutputCallRequest(), timeout=10
                ):
                    got.append(response.payload.body)
            assert got == [b"bad"]
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert channel.route.statistics().sent == {"bad": 1}  # not re-sent
        assert len(bad.record.requests) == 1


async def test_a_stream_call_has_what_the_plain_channels_has(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with discovery(servers[0].instance()) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            request = pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters()])
            call = stub.StreamingOutputCall(request, timeout=10)
            for name in (
                "read", "write", "done_writing", "initial_metadata", "trailing_metadata",
                "code", "details", "cancel", "cancelled", "done", "wait_for_connection",
            ):  # fmt: skip
                assert callable(getattr(call, name)), name
            await call.wait_for_connection()
            assert isinstance(await call.initial_metadata(), grpc.aio.Metadata)
            # code() and details() wait for the status (reading what is left).
            assert await call.code() == grpc.StatusCode.OK
            assert await call.details() == ""
            assert isinstance(await call.trailing_metadata(), grpc.aio.Metadata)
            assert call.done()
            assert await call.read() is grpc.aio.EOF

            missing = channel.unary_stream("/grpc.testing.TestService/NoSuchMethod")
            failed = missing(b"", timeout=10)
            assert await failed.code() == grpc.StatusCode.UNIMPLEMENTED
            assert await failed.details()
            with pytest.raises(RpcError):
                await failed.read()

            with_iterator = stub.FullDuplexCall(requests(pb), timeout=10)
            with pytest.raises(RuntimeError, match="without a request iterator"):
                await with_iterator.write(requests(pb)[0])
            with_iterator.cancel()
            # Both calls ended: no load guard stays open.
            stats = channel.route.statistics()
            assert stats.in_flight == {"b0": 0}


async def test_write_and_done_writing_stay_on_one_instance(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 2) as servers:
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            call = stub.FullDuplexCall(timeout=10)
            answers = []
            for request in requests(pb):
                await call.write(request)
                answers.append((await call.read()).payload.body)
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            name = answers[0].split(b":")[0]
            assert answers == [name + b":" + p for p in PAYLOADS]
            assert channel.route.statistics().sent == {name.decode(): 1}
            assert await call.code() == grpc.StatusCode.OK
            assert channel.route.statistics().in_flight == {"b0": 0, "b1": 0}
