"""One call awaited from several tasks at once, as ``grpc.aio`` allows: every
waiter gets the call's own answer (no waiter left behind, no message taken
twice)."""

from __future__ import annotations

import anyio
import grpc
import h2.events
import pytest

from nadisc.grpc import Channel
from nadisc.grpc._wire import encode_message

from .support import Conn, Scenario, h2_server

METHOD = "/waiters.Service/Call"


def _slow_answer(messages: int) -> Scenario:
    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id or 0
            await anyio.sleep(0.05)  # every waiter is waiting before anything arrives
            await conn.respond(sid)
            for n in range(messages):
                await conn.data(sid, encode_message(b"m%d" % n, False))
            await conn.trailers(sid)

    return scenario


async def test_a_unary_call_awaited_with_its_status_and_metadata_at_once() -> None:
    async with h2_server(_slow_answer(1)) as server, Channel(f"127.0.0.1:{server.port}") as ch:
        call = ch.unary_unary(METHOD)(b"go", timeout=10)
        got: dict[str, object] = {}

        async def take(name: str, read: object) -> None:
            got[name] = await read  # type: ignore[misc]

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(take, "response", call)
                tg.start_soon(take, "code", call.code())
                tg.start_soon(take, "initial", call.initial_metadata())
        assert got["response"] == b"m0"
        assert got["code"] == grpc.StatusCode.OK


async def test_a_stream_read_while_another_task_waits_for_its_metadata() -> None:
    async with h2_server(_slow_answer(3)) as server, Channel(f"127.0.0.1:{server.port}") as ch:
        call = ch.unary_stream(METHOD)(b"go", timeout=10)
        got: dict[str, object] = {}

        async def read_all() -> None:
            got["messages"] = [m async for m in call]

        async def metadata() -> None:
            got["initial"] = await call.initial_metadata()

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(metadata)
                tg.start_soon(read_all)
        assert got["messages"] == [b"m0", b"m1", b"m2"]
        assert await call.code() == grpc.StatusCode.OK


async def test_waiters_of_a_call_whose_awaiting_task_is_cancelled_get_cancelled() -> None:
    """Cancelling the task that awaits a call cancels the call (as in grpc.aio):
    another task waiting for its status gets CANCELLED, not a hang."""

    async def never(conn: Conn, event: h2.events.Event) -> None:
        return None  # the server never answers

    async with h2_server(never) as server, Channel(f"127.0.0.1:{server.port}") as ch:
        call = ch.unary_unary(METHOD)(b"go", timeout=10)
        codes: list[grpc.StatusCode] = []

        async def status() -> None:
            codes.append(await call.code())

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                awaiting = anyio.CancelScope()

                async def await_call() -> None:
                    with awaiting:
                        await call

                tg.start_soon(await_call)
                await anyio.wait_all_tasks_blocked()  # the call is open and waiting
                tg.start_soon(status)
                await anyio.wait_all_tasks_blocked()  # and so is the status
                awaiting.cancel()
        assert codes == [grpc.StatusCode.CANCELLED]
        assert call.done()


async def test_a_stream_call_that_failed_to_open_answers_every_accessor() -> None:
    """A call whose stream the server reset before any response: reading
    raises the call's error, and later looks at it answer without waiting:
    its code, and empty initial metadata (as grpc.aio gives)."""

    async def reset(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.StreamEnded):
            conn.h2.reset_stream(event.stream_id or 0, error_code=2)  # INTERNAL_ERROR
            await conn.flush()

    async with h2_server(reset) as server, Channel(f"127.0.0.1:{server.port}") as ch:
        call = ch.unary_stream(METHOD)(b"go", timeout=10)
        with anyio.fail_after(5):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                _ = [m async for m in call]
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert await call.code() == grpc.StatusCode.INTERNAL
            assert list(await call.initial_metadata()) == []
