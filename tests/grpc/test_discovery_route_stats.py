"""How the route statistics of a discovery channel classify gRPC outcomes.

As the HTTP transport does (docs/observability.md, "What counts as a balancer
failure"): an application status from a healthy instance (NOT_FOUND,
INVALID_ARGUMENT, ...) is a success of the transport; UNAVAILABLE, INTERNAL,
UNKNOWN or RESOURCE_EXHAUSTED sent by the server is ``status``; a refused
connection (and any failure the client saw on the connection or stream) is
``transport``; the call's own deadline is ``timeout``; a call that reached
no instance is ``no_endpoint``. Every finished call (unary or streaming) is
in the latency histogram of its outcome.
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import grpc
import httpx
import pytest

from nadisc import Instance
from nadisc.grpc import RpcError
from nadisc.observability import console_app
from tests.grpc.conftest import Opener
from tests.grpc.discovery_support import HOLD, backends, failing
from tests.grpc.test_discovery_calls import PLAIN, closed_port

APPLICATION = [
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE,
]
SERVER_FAILURES = [
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
]


def calls_in(stats: Any, outcome: str) -> int:
    counts, _total = stats.latency[outcome]
    return int(sum(counts))


async def test_application_statuses_are_successes_of_the_transport(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with discovery(servers[0].instance()) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            for _ in range(3):
                await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            for code in APPLICATION:
                with pytest.raises(RpcError) as info:
                    await stub.UnaryCall(failing(pb, code), timeout=10)
                assert info.value.code() == code
            request = pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters()])
            assert len([m async for m in stub.StreamingOutputCall(request, timeout=10)]) == 1
            stats = channel.route.statistics()
            assert sum(stats.failures.values()) == 0
            assert stats.failed == {} and stats.ejected == {}
            # Every finished call is in the ``ok`` histogram, streaming ones too.
            assert calls_in(stats, "ok") == 3 + len(APPLICATION) + 1
            assert stats.latency["ok"][1] > 0


@pytest.mark.parametrize("code", SERVER_FAILURES, ids=lambda code: code.name)
async def test_a_failure_status_the_server_sent_is_status(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType, code: grpc.StatusCode
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with discovery(servers[0].instance()) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            with pytest.raises(RpcError):
                await stub.UnaryCall(failing(pb, code), timeout=10)
            stats = channel.route.statistics()
            assert stats.failures["status"] == 1 and stats.failed == {"b0": 1}
            assert sum(stats.failures.values()) == 1
            assert calls_in(stats, "status") == 1 and calls_in(stats, "ok") == 0


async def test_a_refused_connection_is_transport_and_the_call_still_ok(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        dead = Instance("dead", "127.0.0.1", closed_port(), metadata=PLAIN)
        async with discovery(dead, servers[0].instance()) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            for _ in range(4):
                await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            stats = channel.route.statistics()
            assert stats.sent["dead"] >= 1
            assert stats.failures["transport"] == stats.sent["dead"]
            assert stats.failures["status"] == 0 and stats.failed == {"dead": stats.sent["dead"]}
            assert calls_in(stats, "ok") == 4


async def test_the_calls_own_deadline_is_timeout(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with discovery(servers[0].instance()) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            with pytest.raises(RpcError) as info:
                await stub.UnaryCall(pb.SimpleRequest(response_size=HOLD), timeout=1.0)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            servers[0].release.set()
            stats = channel.route.statistics()
            assert stats.failures["timeout"] == 1 and stats.failures["status"] == 0
            assert stats.failed == {"b0": 1}
            assert calls_in(stats, "timeout") == 1


async def test_a_call_that_reached_no_instance_is_no_endpoint(discovery: Opener) -> None:
    async with discovery() as (_owner, channel, _memory):
        with pytest.raises(RpcError) as info:
            await channel.unary_unary("/grpc.testing.TestService/UnaryCall")(b"", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        stats = channel.route.statistics()
        assert stats.failures["no_endpoint"] == 1 and stats.failed == {}
        assert calls_in(stats, "no_endpoint") == 1


async def test_a_call_the_caller_cancelled_is_no_outcome(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with discovery(servers[0].instance()) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            request = pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters()])
            call = stub.StreamingOutputCall(request, timeout=10)
            await call.read()
            assert call.cancel()
            stats = channel.route.statistics()
            assert sum(stats.failures.values()) == 0 and stats.failed == {}
            assert all(calls_in(stats, outcome) == 0 for outcome in stats.latency)
            assert stats.in_flight == {"b0": 0}


async def test_the_observer_lists_the_route_while_the_channel_is_open(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    """The console, the metrics and ``nadisc watch`` read the owner's
    observer: a discovery channel's route is there while it is open, marked
    ``grpc``, with its calls; gone once the channel closes."""
    with backends(pb, pb_grpc, 1) as servers:
        async with discovery(servers[0].instance()) as (owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            for _ in range(2):
                await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            [route] = [r for r in owner.observer().snapshot().routes if r.protocol == "grpc"]
            assert (route.connection, route.calls, route.in_flight) == ("primary", 2, 0)
            assert [e.identity for e in route.endpoints] == ["b0"]
            assert dict(route.failures)["status"] == 0
            # The console shows it as a card of its own, marked gRPC.
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=console_app(owner)), base_url="http://localhost"
            ) as reader:
                state = json.loads((await reader.get("/state")).text)
            card = state["routes"][f"primary/{route.service} (grpc)"]
            assert (card["protocol"], card["calls"]) == ("grpc", 2)
            await channel.close()
            assert not [r for r in owner.observer().snapshot().routes if r.protocol == "grpc"]
