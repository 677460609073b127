"""The caller's cancel-scope deadline ends a call as the caller's cancellation.

The scope's deadline goes to the server as ``grpc-timeout``; the server's
DEADLINE_EXCEEDED for it can be handled before the scope's own timer (on
asyncio, I/O callbacks run before timers in a loop iteration). The caller
must still see its scope cancel the call, not an ``RpcError``; and a
discovery channel must not take that answer as the instance's own failure
(which would count toward its ejection). Both loops.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import anyio
import grpc

from nadisc._route import STATUS, TIMEOUT
from nadisc.grpc import Channel, RpcError
from nadisc.grpc._discovery import failure_of

from .support import Conn, h2_server

METHOD = "/deadline.Service/Call"


async def silent(conn: Conn, event: object) -> None:
    """Takes the requests and never answers them."""


async def test_the_servers_deadline_exceeded_after_the_scope_deadline_is_a_cancellation() -> None:
    async with (
        h2_server(silent) as server,
        Channel(f"127.0.0.1:{server.port}") as channel,
    ):
        call = channel.stream_stream(METHOD)()

        async def answer_late() -> None:
            # What the reader hands the caller when the server's answer wins
            # the race: the scope's deadline has passed (the shield kept its
            # cancellation from being delivered), and no checkpoint since.
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.3)
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

        with anyio.fail_after(5):
            with anyio.move_on_after(0.1) as scope:
                await call._guard(answer_late)
        assert scope.cancelled_caught


async def test_without_a_caller_scope_the_servers_answer_is_the_error() -> None:
    async with (
        h2_server(silent) as server,
        Channel(f"127.0.0.1:{server.port}") as channel,
    ):
        call = channel.stream_stream(METHOD)()

        async def answer() -> None:
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

        with anyio.fail_after(5):
            try:
                await call._guard(answer)
            except RpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            else:
                raise AssertionError("the server's DEADLINE_EXCEEDED was not raised")


async def test_discovery_does_not_blame_an_instance_for_the_callers_deadline() -> None:
    answered = SimpleNamespace(server_answered=True, stream_unprocessed=False)
    error = RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    now = anyio.current_time()
    # The call has no deadline of its own; the caller's scope's has passed.
    with anyio.CancelScope(deadline=now - 0.001):  # noqa: ASYNC100 - read, not awaited
        assert failure_of(error, answered, now, math.inf) == TIMEOUT
    # Before any deadline of ours: the server's own (like an HTTP 504).
    with anyio.CancelScope(deadline=now + 60):  # noqa: ASYNC100 - read, not awaited
        assert failure_of(error, answered, now, math.inf) == STATUS
    assert failure_of(error, answered, now, now + 60) == STATUS
