"""1,000 in-flight calls of all four kinds cancelled at random points, against grpcio.

Afterwards: no task of the channel beyond its connection's own, no stream
left open on the client, and (asked through the server's ``Control.Stats``,
which counts handlers still running) none on the server either.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import anyio
import anyio.lowlevel
import grpc
import pytest

from nadisc.grpc import Channel, RpcError

from .conftest import Server
from .support import grpc_tasks

CALLS = 1000
AT_ONCE = 50


async def slow_requests(pb: ModuleType, make: Any) -> AsyncIterator[Any]:
    for _ in range(1000):
        yield make(pb)
        await anyio.sleep(0.001)


async def one_call(stub: Any, pb: ModuleType, kind: int, rng: random.Random) -> None:
    if kind == 0:
        # response_size 7 makes the server's handler sleep until cancelled.
        size = rng.choice((7, 10))
        await stub.UnaryCall(pb.SimpleRequest(response_size=size))
    elif kind == 1:
        params = [pb.ResponseParameters(size=100, interval_us=500) for _ in range(200)]
        async for _ in stub.StreamingOutputCall(
            pb.StreamingOutputCallRequest(response_parameters=params)
        ):
            pass
    elif kind == 2:
        await stub.StreamingInputCall(
            slow_requests(
                pb, lambda pb: pb.StreamingInputCallRequest(payload=pb.Payload(body=b"x"))
            )
        )
    else:
        requests = slow_requests(
            pb,
            lambda pb: pb.StreamingOutputCallRequest(
                response_parameters=[pb.ResponseParameters(size=10)]
            ),
        )
        async for _ in stub.FullDuplexCall(requests):
            pass


async def server_active(control: Any, pb: ModuleType) -> int:
    stats = await control.Stats(pb.Empty(), timeout=5)
    return int(stats.active_calls)


@pytest.mark.parametrize("transport", ["plain"])
async def test_random_cancellations_leave_nothing(
    transport: str, grpcio_server: Server, pb: ModuleType, pb_grpc: ModuleType
) -> None:
    rng = random.Random(28)
    outcomes = {"cancelled": 0, "completed": 0, "error": 0}
    async with Channel(
        grpcio_server.target(transport), ssl_context=grpcio_server.ssl_context(transport)
    ) as channel:
        stub = pb_grpc.TestServiceStub(channel)
        control = pb_grpc.ControlStub(channel)
        assert await server_active(control, pb) == 0
        limiter = anyio.CapacityLimiter(AT_ONCE)

        async def run(index: int) -> None:
            kind = index % 4
            delay = rng.uniform(0, 0.02)
            async with limiter:
                with anyio.move_on_after(delay) as scope:
                    try:
                        await one_call(stub, pb, kind, rng)
                    except RpcError as exc:
                        assert exc.code() != grpc.StatusCode.INTERNAL, exc
                        outcomes["error"] += 1
                        return
                outcomes["cancelled" if scope.cancelled_caught else "completed"] += 1

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for index in range(CALLS):
                    tg.start_soon(run, index)
        assert sum(outcomes.values()) == CALLS
        assert outcomes["cancelled"] > CALLS // 2
        # The client: no stream, no task beyond the connection's reader and writer.
        await anyio.lowlevel.checkpoint()
        conn = await channel.connection()
        assert conn.streams == {}
        assert grpc_tasks() <= 2
        # The server: every handler ended (its cancellation is asynchronous: wait).
        with anyio.fail_after(20):
            while await server_active(control, pb) != 0:  # noqa: ASYNC110
                await anyio.sleep(0.05)
