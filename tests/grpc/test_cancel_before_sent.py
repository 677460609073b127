"""``cancel()`` on a call that has not opened its stream yet sends nothing.

A call waits before its stream opens while the connection is being made,
until the server's first SETTINGS arrive, and while the server's
``SETTINGS_MAX_CONCURRENT_STREAMS`` are all in use. ``cancel()`` during any
of those waits ends the call with ``CANCELLED`` at once, and the request is
never sent (a server that wakes up later sees nothing), as ``grpc.aio``
promises for a call cancelled before it was sent. Both loops.
"""

from __future__ import annotations

from typing import Any

import anyio
import grpc
import h2.events
import h2.settings
import pytest

from nadisc.grpc import Channel, RpcError

from .support import HEADERS, PREFACE, Conn, frame, frame_types, h2_server, hung_listener

METHOD = "/cancel.Service/Call"


async def until(predicate: Any) -> None:
    """Until ``predicate()`` holds (what a listener saw has no event), at most 5 s."""
    with anyio.fail_after(5):
        while not predicate():  # noqa: ASYNC110 - the listener's record has no event
            await anyio.sleep(0.01)


async def ended(call: Any, results: list[object]) -> None:
    try:
        results.append(await call)
    except RpcError as exc:
        results.append(exc)


@pytest.mark.parametrize("kind", ["unary", "stream"])
async def test_cancel_while_waiting_for_settings_sends_nothing(kind: str) -> None:
    results: list[object] = []
    async with hung_listener() as hung:
        async with Channel(f"127.0.0.1:{hung.port}", connect_timeout=None) as channel:
            await in_channel(channel, kind, hung, results)
        await until(lambda: hung.ended == 1)
    assert HEADERS not in frame_types(hung.received[len(PREFACE) :])


async def in_channel(channel: Channel, kind: str, hung: Any, results: list[object]) -> None:
    """Start one call, cancel it once the listener has the preface, check how it ended."""
    if kind == "unary":
        call: Any = channel.unary_unary(METHOD)(b"never sent")
        waiting = call
    else:
        call = channel.unary_stream(METHOD)(b"never sent")
        waiting = call.read()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ended, waiting, results)
            await until(lambda: hung.received.startswith(PREFACE))
            assert call.cancel()
    assert isinstance(results[0], RpcError)
    assert results[0].code() == grpc.StatusCode.CANCELLED
    assert await call.code() == grpc.StatusCode.CANCELLED
    assert not call.cancel()  # already done


async def test_cancel_while_queued_for_a_stream_slot_sends_nothing() -> None:
    release = anyio.Event()

    async def one_at_a_time(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.StreamEnded) and event.stream_id:
            if len(conn.record.requests) == 1:
                await release.wait()  # holds the only slot
            await conn.respond(event.stream_id)
            await conn.data(event.stream_id, frame(b"ok"))
            await conn.trailers(event.stream_id)

    settings: dict[int, int] = {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1}
    first: list[object] = []
    queued: list[object] = []
    async with (
        h2_server(one_at_a_time, settings=settings) as server,
        Channel(f"127.0.0.1:{server.port}") as channel,
    ):
        method = channel.unary_unary(METHOD)
        await channel.connection()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ended, method(b"first"), first)
                await until(lambda: len(server.record.requests) == 1)
                call = method(b"queued")
                tg.start_soon(ended, call, queued)
                await until(lambda: channel._conn is not None and channel._conn._waiting == 1)
                assert call.cancel()
                await until(lambda: bool(queued))
                assert isinstance(queued[0], RpcError)
                assert queued[0].code() == grpc.StatusCode.CANCELLED
                release.set()
        assert first == [b"ok"]
        assert await method(b"after") == b"ok"
        # The server saw the first call and the one after, never the cancelled one.
        assert len(server.record.requests) == 2
