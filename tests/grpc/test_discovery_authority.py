"""A registry-supplied ``:authority`` (``nadisc-grpc-authority``) is checked when the
instance is listed: an invalid one (non-ASCII, a blank, a line break, empty) keeps
that instance out of the balance. It is never dialled and never blamed; the other
instances take the calls, and with none left a call raises ``GrpcProtocolError``
naming the instance and the key (never a raw ``UnicodeEncodeError``, never a
header with CR/LF on the wire).
"""

from __future__ import annotations

from types import ModuleType

import anyio
import grpc
import h2.events
import pytest

from nadisc import Instance
from nadisc._grpc_protocol import GRPC_AUTHORITY_KEY, GRPC_TLS_KEY
from nadisc.grpc import GrpcProtocolError
from tests.grpc.conftest import SERVICE, Opener
from tests.grpc.discovery_support import backends
from tests.grpc.support import Conn, h2_server

BAD_AUTHORITIES = ["bücher.example:443", "bad host\r\nx-injected: 1", "", "a b:80", "tab\t:1"]


@pytest.mark.parametrize("authority", BAD_AUTHORITIES)
async def test_an_invalid_authority_leaves_its_instance_out(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType, authority: str
) -> None:
    with backends(pb, pb_grpc, 2) as (bad, good):
        bad_one = bad.instance(**{GRPC_TLS_KEY: "plaintext", GRPC_AUTHORITY_KEY: authority})
        async with discovery(bad_one, good.instance()) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            for _ in range(4):
                response = await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                assert response.username == "b1"
            request = pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters()])
            bodies = [m.payload.body async for m in stub.StreamingOutputCall(request, timeout=10)]
            assert bodies == [b"b1"]
            assert set(channel.rejected) == {"b0"}
            stats = channel.route.statistics()
            # Never picked, so never blamed.
            assert "b0" not in stats.sent and stats.failed == {}
            assert sum(stats.failures.values()) == 0
        assert bad.calls == 0


@pytest.mark.parametrize("authority", BAD_AUTHORITIES)
async def test_with_no_other_instance_the_call_names_the_instance_and_the_key(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType, authority: str
) -> None:
    async with h2_server(_never) as server:
        meta = {GRPC_TLS_KEY: "plaintext", GRPC_AUTHORITY_KEY: authority}
        only = Instance("only", "127.0.0.1", server.port, metadata=meta)
        async with discovery(only) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            for _ in range(2):
                with pytest.raises(GrpcProtocolError) as info:
                    await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                message = str(info.value)
                assert "'only'" in message and GRPC_AUTHORITY_KEY in message
                assert "\r" not in message and "\n" not in message
            with pytest.raises(GrpcProtocolError):
                request = pb.StreamingOutputCallRequest()
                async for _ in stub.StreamingOutputCall(request, timeout=10):
                    pass
            stats = channel.route.statistics()
            assert stats.failed == {} and stats.sent == {}
            assert stats.failures["no_endpoint"] == 3
        assert server.record.connections == 0  # never dialled


async def _never(conn: Conn, event: h2.events.Event) -> None:
    raise AssertionError("an instance with an invalid authority was dialled")


async def test_a_valid_authority_is_sent(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    async def answer(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived) and event.stream_id:
            await conn.respond(event.stream_id)
            await conn.trailers(event.stream_id, grpc.StatusCode.NOT_FOUND.value[0], b"none")

    async with h2_server(answer) as server:
        meta = {GRPC_TLS_KEY: "plaintext", GRPC_AUTHORITY_KEY: "orders.internal:443"}
        only = Instance("only", "127.0.0.1", server.port, metadata=meta)
        async with discovery(only) as (_owner, channel, _memory):
            call = channel.unary_unary("/grpc.testing.TestService/UnaryCall")(b"", timeout=10)
            assert await call.code() == grpc.StatusCode.NOT_FOUND
            assert channel.rejected == {}
        ((_stream, headers),) = server.record.requests
        assert headers[b":authority"] == b"orders.internal:443"


async def test_a_listing_with_a_valid_authority_brings_the_instance_back(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as (server,):
        bad = server.instance(**{GRPC_TLS_KEY: "plaintext", GRPC_AUTHORITY_KEY: "bücher:443"})
        async with discovery(bad, watch=True) as (_owner, channel, memory):
            stub = pb_grpc.TestServiceStub(channel)
            with pytest.raises(GrpcProtocolError):
                await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            memory.set(SERVICE, [server.instance()])
            # The listing change reaches the route before the next pick.
            with anyio.fail_after(10):
                while channel.route.current("b0") is None:
                    channel.route.snapshot()
                    await anyio.sleep(0.01)
            response = await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            assert response.username == "b0"
            assert channel.rejected == {}
        assert server.calls == 1
