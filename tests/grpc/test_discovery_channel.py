"""The discovery channel against real grpcio servers listed by the memory registry.

Generated ``TestServiceStub`` objects take the discovery channel unchanged;
calls spread over the listed instances, a departed instance gets no new call,
its stream in flight is cancelled as UNAVAILABLE after the drain budget, and
the protocol comes from exactly one source.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import ModuleType
from typing import Any

import anyio
import grpc
import pytest

from nadisc import EvidenceUnavailable, Instance
from nadisc.grpc import (
    DiscoveryChannel,
    DiscoveryProtocol,
    GrpcProtocolConflict,
    GrpcProtocolMissing,
    RpcError,
)
from tests.grpc.conftest import SERVICE, Opener
from tests.grpc.discovery_support import HOLD, Backend, backends, failing


async def test_calls_spread_over_the_listed_instances(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 3) as servers:
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            names = set()
            for _ in range(30):
                response = await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                names.add(response.username)
            assert names == {"b0", "b1", "b2"}
            assert channel.subchannel_count() == 3
            assert channel.stats.codes[grpc.StatusCode.OK.value[0]] == 30
            assert sum(s.calls for s in servers) == 30


async def test_a_departed_instance_gets_no_new_call(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 2) as servers:
        instances = [s.instance() for s in servers]
        async with discovery(*instances, watch=True, drain=0.5) as (_owner, channel, memory):
            stub = pb_grpc.TestServiceStub(channel)
            for _ in range(4):
                await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            assert servers[1].calls > 0
            memory.set(SERVICE, [servers[0].instance()])
            # The listing change reaches the route before the next pick.
            while channel.route.current("b1") is not None:
                channel.route.snapshot()
                await anyio.sleep(0.01)
            before = servers[1].calls
            for _ in range(10):
                response = await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                assert response.username == "b0"
            assert servers[1].calls == before


@asynccontextmanager
async def departed_stream(
    discovery: Opener,
    pb: ModuleType,
    pb_grpc: ModuleType,
    *,
    drain: float,
    interval_us: int,
    messages: int,
) -> AsyncIterator[tuple[Backend, DiscoveryChannel, Any]]:
    """A server stream whose one instance leaves the listing after its first message."""
    with backends(pb, pb_grpc, 1) as servers:
        async with discovery(servers[0].instance(), watch=True, drain=drain) as (
            _owner,
            channel,
            memory,
        ):
            stub = pb_grpc.TestServiceStub(channel)
            request = pb.StreamingOutputCallRequest(
                response_parameters=[pb.ResponseParameters(interval_us=interval_us)] * messages
            )
            call = stub.StreamingOutputCall(request, timeout=30)
            assert (await call.read()).payload.body == b"b0"
            memory.set_empty(SERVICE)
            yield servers[0], channel, call


async def test_a_stream_of_a_departed_instance_ends_unavailable_after_the_drain(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    async with departed_stream(
        discovery, pb, pb_grpc, drain=0.2, interval_us=200_000, messages=100
    ) as (
        server,
        channel,
        call,
    ):
        with pytest.raises(RpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert channel.subchannel_count() == 0
        # No instance left: a new call is refused, nothing sent.
        calls = server.calls
        with pytest.raises(RpcError) as refused:
            await pb_grpc.TestServiceStub(channel).UnaryCall(pb.SimpleRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert server.calls == calls


async def test_a_stream_of_a_departed_instance_finishes_within_the_drain(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    async with departed_stream(
        discovery, pb, pb_grpc, drain=30, interval_us=50_000, messages=6
    ) as (
        _server,
        channel,
        call,
    ):
        with anyio.fail_after(10):
            await channel.route.observation.changed()
        with pytest.raises(EvidenceUnavailable):
            channel.route.snapshot()  # no instance left for a new call
        rest = [m async for m in call]
        assert len(rest) == 5
        assert channel.subchannel_count() == 0  # retired while its stream went on
        assert channel.stats.codes[grpc.StatusCode.OK.value[0]] == 1


async def test_discovery_protocol_dials_instances_without_metadata(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        bare = Instance("b0", "127.0.0.1", servers[0].port)
        async with discovery(bare, protocol=DiscoveryProtocol(authority="orders.local")) as (
            _owner,
            channel,
            _memory,
        ):
            response = await pb_grpc.TestServiceStub(channel).UnaryCall(
                pb.SimpleRequest(), timeout=10
            )
            assert response.username == "b0"


async def test_no_protocol_source_is_a_typed_error(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        bare = Instance("b0", "127.0.0.1", servers[0].port)
        async with discovery(bare) as (_owner, channel, _memory):
            with pytest.raises(GrpcProtocolMissing, match="DiscoveryProtocol") as info:
                await pb_grpc.TestServiceStub(channel).UnaryCall(pb.SimpleRequest(), timeout=5)
            assert "'orders'" in str(info.value)
            assert servers[0].calls == 0


async def test_both_protocol_sources_are_a_typed_error(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with discovery(servers[0].instance(), protocol=DiscoveryProtocol()) as (
            _owner,
            channel,
            _memory,
        ):
            with pytest.raises(GrpcProtocolConflict) as info:
                await pb_grpc.TestServiceStub(channel).UnaryCall(pb.SimpleRequest(), timeout=5)
            assert "service 'orders'" in str(info.value)
            assert servers[0].calls == 0


async def test_an_owner_closing_under_the_channel_refuses_new_calls(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with discovery(servers[0].instance(), drain=0.2) as (owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            report = await owner.begin_close(anyio.current_time() + 5).wait()
            assert report is not None
            with pytest.raises(RpcError) as info:
                await stub.UnaryCall(pb.SimpleRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert channel.subchannel_count() == 0
        assert servers[0].calls == 1


async def test_a_server_stream_runs_to_its_end_on_one_instance(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 2) as servers:
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            request = pb.StreamingOutputCallRequest(
                response_parameters=[pb.ResponseParameters()] * 3
            )
            for _ in range(2):
                bodies = [
                    m.payload.body async for m in stub.StreamingOutputCall(request, timeout=10)
                ]
                assert len(bodies) == 3 and len(set(bodies)) == 1
            assert channel.stats.codes[grpc.StatusCode.OK.value[0]] == 2
            assert all(count == 0 for count in channel.route.statistics().in_flight.values())


async def test_a_stream_used_from_two_tasks_at_once_is_one_call(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    """One task waits for the initial metadata while another reads: the call
    is picked and sent once, and both see it."""
    with backends(pb, pb_grpc, 2) as servers:
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            request = pb.StreamingOutputCallRequest(
                response_parameters=[pb.ResponseParameters()] * 3
            )
            before = sum(s.calls for s in servers)
            call = stub.StreamingOutputCall(request, timeout=10)
            got: dict[str, Any] = {}

            async def metadata() -> None:
                got["initial"] = await call.initial_metadata()

            async def read_all() -> None:
                got["bodies"] = [m.payload.body async for m in call]

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(metadata)
                    tg.start_soon(read_all)
            assert len(got["bodies"]) == 3
            assert got["initial"] is not None
            assert await call.code() == grpc.StatusCode.OK
            assert sum(s.calls for s in servers) == before + 1
            assert all(count == 0 for count in channel.route.statistics().in_flight.values())


async def test_a_unary_call_has_grpc_aio_s_accessors_from_several_tasks(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    """Awaited, and its status and metadata awaited, from three tasks at once:
    one RPC, one answer for all, and the same answer when awaited again."""
    with backends(pb, pb_grpc, 2) as servers:
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            call = stub.UnaryCall(pb.SimpleRequest(response_size=20), timeout=10)
            got: dict[str, Any] = {}

            async def take(name: str, awaitable: Any) -> None:
                got[name] = await awaitable

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(take, "response", call)
                    tg.start_soon(take, "code", call.code())
                    tg.start_soon(take, "trailing", call.trailing_metadata())
                assert got["code"] == grpc.StatusCode.OK
                assert got["response"].username in {"b0", "b1"}
                assert (await call).username == got["response"].username
                assert await call.details() == ""
                assert await call.initial_metadata() is not None
            assert call.done() and not call.cancel()
            assert sum(s.calls for s in servers) == 1


async def test_a_failed_unary_call_reports_its_status_to_every_accessor(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            call = stub.UnaryCall(failing(pb, grpc.StatusCode.NOT_FOUND, "no such"), timeout=10)
            with anyio.fail_after(10):
                assert await call.code() == grpc.StatusCode.NOT_FOUND
                assert await call.details() == "no such"
                for _ in range(2):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call
                    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert servers[0].calls == 1


async def test_a_cancelled_unary_call_sends_nothing_more(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    """Cancelled before it was awaited: nothing is sent. Cancelled in flight:
    the attempt is reset, no other instance is tried, its load guard ends."""
    with backends(pb, pb_grpc, 2) as servers:
        async with discovery(*(s.instance() for s in servers)) as (_owner, channel, _memory):
            stub = pb_grpc.TestServiceStub(channel)
            early = stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            assert early.cancel() and early.cancelled()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await early
            assert caught.value.code() == grpc.StatusCode.CANCELLED
            assert sum(s.calls for s in servers) == 0

            arrived = threading.Event()  # the call reached either server
            for server in servers:
                server.arrived = arrived
            held = stub.UnaryCall(pb.SimpleRequest(response_size=HOLD), timeout=10)

            async def sent() -> None:
                assert await anyio.to_thread.run_sync(arrived.wait, 10)

            assert await _code_when_cancelled(held, sent) == grpc.StatusCode.CANCELLED
            for s in servers:
                s.release.set()
            assert sum(s.calls for s in servers) == 1
            assert all(count == 0 for count in channel.route.statistics().in_flight.values())


async def test_a_unary_call_cancelled_while_its_subchannel_opens_sends_nothing(
    discovery: Opener, pb: ModuleType, pb_grpc: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backends(pb, pb_grpc, 1) as servers:
        async with discovery(servers[0].instance()) as (_owner, channel, _memory):
            opening = anyio.Event()
            go_on = anyio.Event()
            open_subchannel = channel.subchannel

            async def slow_subchannel(instance: Instance) -> Any:
                opening.set()
                await go_on.wait()
                return await open_subchannel(instance)

            monkeypatch.setattr(channel, "subchannel", slow_subchannel)
            stub = pb_grpc.TestServiceStub(channel)
            call = stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            code = await _code_when_cancelled(call, opening.wait, then=go_on.set)
            assert code == grpc.StatusCode.CANCELLED
            assert servers[0].calls == 0
            assert all(count == 0 for count in channel.route.statistics().in_flight.values())


async def _code_when_cancelled(
    call: Any, reached: Callable[[], Awaitable[object]], then: Callable[[], object] = lambda: None
) -> Any:
    """What ``call.code()``, awaited by another task, gives when ``call`` is
    cancelled once ``reached()`` returned (and ``then()`` ran)."""
    codes: list[grpc.StatusCode] = []

    async def wait_code() -> None:
        codes.append(await call.code())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_code)
            await reached()
            assert call.cancel()
            then()
    (code,) = codes
    return code


def test_the_owner_does_not_import_nadisc_grpc() -> None:
    import subprocess
    import sys

    code = "import sys, nadisc; assert 'nadisc.grpc' not in sys.modules, 'imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
