"""The health client against grpcio-health-checking's servicer (the interop server's)."""

from __future__ import annotations

import itertools

import anyio
import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nadisc.grpc import Channel, HealthClient, HealthStatus, RpcError
from nadisc.grpc._health import decode_response, encode_request

from .conftest import Server


async def test_check(grpcio_server: Server, transport: str) -> None:
    async with Channel(
        grpcio_server.target(transport), ssl_context=grpcio_server.ssl_context(transport)
    ) as channel:
        health = HealthClient(channel)
        assert await health.check(timeout=5) == HealthStatus.SERVING
        assert await health.check("grpc.testing.TestService", timeout=5) == HealthStatus.SERVING
        assert await health.check("down", timeout=5) == HealthStatus.NOT_SERVING
        with pytest.raises(RpcError) as caught:
            await health.check("no.such.Service", timeout=5)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_watch_sees_changes(grpcio_server: Server) -> None:
    async with Channel(grpcio_server.target("plain")) as channel:
        health = HealthClient(channel)
        seen: list[HealthStatus] = []
        with anyio.fail_after(10):
            watch = health.watch("flip")
            async for status in watch:
                seen.append(status)
                if len(seen) == 3:
                    break
            await watch.aclose()
        # The server flips "flip" every 50 ms: Watch reports each change.
        assert set(seen) == {HealthStatus.SERVING, HealthStatus.NOT_SERVING}
        assert all(a != b for a, b in itertools.pairwise(seen))
        unknown = health.watch("no.such.Service")
        with anyio.fail_after(10):
            assert await unknown.__anext__() == HealthStatus.SERVICE_UNKNOWN
            await unknown.aclose()
        await anyio.lowlevel.checkpoint()
        conn = await channel.connection()
        assert conn.streams == {}


@given(st.text(max_size=300))
def test_request_encoding_round_trips_through_protobuf(service: str) -> None:
    from grpc_health.v1 import health_pb2

    assert health_pb2.HealthCheckRequest.FromString(encode_request(service)).service == service


@given(st.sampled_from(list(HealthStatus)), st.binary(max_size=20))
def test_response_decoding_matches_protobuf(status: HealthStatus, junk: bytes) -> None:
    from grpc_health.v1 import health_pb2

    raw = health_pb2.HealthCheckResponse(status=int(status)).SerializeToString()
    # An unknown length-delimited field (number 9) is skipped.
    extra = b"\x4a" + bytes([len(junk)]) + junk
    assert decode_response(raw + extra) == status
    assert decode_response(extra + raw) == status
