"""The connection attempt is bounded (``connect_timeout``), and closing never breaks HTTP/2.

A server that accepts TCP and never sends its SETTINGS (or never finishes the
TLS handshake) fails the calls waiting on it with ``UNAVAILABLE`` after
``connect_timeout`` (grpc's 20 s by default) even without a deadline, and
the connection is dropped. Tests asking for ``autojump_clock`` run on trio's
virtual clock (trio only); the others use a real listener and a short
timeout on both loops, with 10x bounds.

After the channel's own GOAWAY, frames from the server (its late SETTINGS,
replies) are dropped: never a second GOAWAY with ``PROTOCOL_ERROR``.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import anyio.abc
import grpc
import h2.config
import h2.connection
import h2.events
import pytest
from h2.errors import ErrorCodes

from nadisc.grpc import Channel, RpcError

from .support import DATA, HEADERS, PREFACE, answer_ok, frame_types, h2_server, hung_listener

METHOD = "/connect.Service/Call"


async def until(predicate: Any) -> None:
    """Until ``predicate()`` holds (what the listener saw has no event), at most 5 s."""
    with anyio.fail_after(5):
        while not predicate():  # noqa: ASYNC110 - the listener's record has no event
            await anyio.sleep(0.01)


# -- virtual time (trio) ---------------------------------------------------------------


async def test_no_settings_fails_a_call_without_deadline_at_twenty_seconds(
    autojump_clock: object,
) -> None:
    async with hung_listener() as hung, Channel(f"127.0.0.1:{hung.port}") as channel:
        start = anyio.current_time()
        with pytest.raises(RpcError) as caught:
            await channel.unary_unary(METHOD)(b"no deadline")
        took = anyio.current_time() - start
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        details = caught.value.details() or ""
        assert "SETTINGS" in details and "connect_timeout" in details and "20.0 s" in details
        assert 20.0 <= took < 20.5
        # The connection is dropped, and the next call opens a new one.
        await until(lambda: hung.ended == 1)
        with pytest.raises(RpcError):
            await channel.unary_unary(METHOD)(b"again")
        assert hung.accepted == 2


async def test_connect_timeout_bounds_every_waiting_call(autojump_clock: object) -> None:
    errors: list[RpcError] = []

    async def one(make: Any) -> None:
        with pytest.raises(RpcError) as caught:
            await make()
        errors.append(caught.value)

    async with (
        hung_listener() as hung,
        Channel(f"127.0.0.1:{hung.port}", connect_timeout=3) as channel,
    ):

        async def stream_response() -> None:
            async for _ in channel.unary_stream(METHOD)(b"x"):
                pass

        async def stream_request() -> None:
            await channel.stream_unary(METHOD)(iter([b"a", b"b"]))

        async def both_ways() -> None:
            call = channel.stream_stream(METHOD)()
            await call.write(b"a")
            await call.read()

        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, lambda: channel.unary_unary(METHOD)(b"x"))
            tg.start_soon(one, stream_response)
            tg.start_soon(one, stream_request)
            tg.start_soon(one, both_ways)
        assert 3.0 <= anyio.current_time() - start < 3.5
    assert len(errors) == 4
    assert all(e.code() == grpc.StatusCode.UNAVAILABLE for e in errors)
    assert all("SETTINGS" in (e.details() or "") for e in errors)
    assert hung.accepted == 1


async def test_a_tls_handshake_that_never_ends_times_out(
    autojump_clock: object, tls_files: Any
) -> None:
    async with (
        hung_listener() as hung,
        Channel(
            f"127.0.0.1:{hung.port}", ssl_context=tls_files.client_context(), connect_timeout=5
        ) as channel,
    ):
        start = anyio.current_time()
        with pytest.raises(RpcError) as caught:
            await channel.unary_unary(METHOD)(b"x")
        assert 5.0 <= anyio.current_time() - start < 5.5
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "TLS handshake" in (caught.value.details() or "")
    assert caught.value.unprocessed  # no request byte was sent: another host may take it


async def test_a_healthy_connection_outlives_the_connect_timeout(autojump_clock: object) -> None:
    async with (
        h2_server(answer_ok) as server,
        Channel(f"127.0.0.1:{server.port}", connect_timeout=1) as channel,
    ):
        method = channel.unary_unary(METHOD)
        assert await method(b"x") == b"ok"
        await anyio.sleep(60)
        assert await method(b"x") == b"ok"
        assert server.record.connections == 1


async def test_keepalive_still_runs_with_the_connect_timeout(autojump_clock: object) -> None:
    async with (
        h2_server(lambda conn, event: anyio.lowlevel.checkpoint()) as server,
        Channel(
            f"127.0.0.1:{server.port}",
            connect_timeout=1,
            keepalive_time=10,
            keepalive_without_calls=True,
        ) as channel,
    ):
        await channel.connection()
        await anyio.sleep(35)
        assert server.record.pings == 3


# -- a real hung listener (both loops) ---------------------------------------------------


async def test_a_silent_server_fails_the_call_after_connect_timeout() -> None:
    async with (
        hung_listener() as hung,
        Channel(f"127.0.0.1:{hung.port}", connect_timeout=0.2) as channel,
    ):
        with anyio.fail_after(2), pytest.raises(RpcError) as caught:
            await channel.unary_unary(METHOD)(b"no deadline")
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "before the server's SETTINGS frame arrived" in (caught.value.details() or "")
        # No stream opens before the server's SETTINGS: the request never went
        # out, so a discovery channel may send it to another instance.
        assert caught.value.unprocessed
        await until(lambda: hung.ended == 1)
        assert hung.received.startswith(PREFACE)
        kinds = frame_types(hung.received[len(PREFACE) :])
        assert kinds and HEADERS not in kinds and DATA not in kinds


async def test_a_silent_tls_server_fails_the_call_after_connect_timeout(tls_files: Any) -> None:
    async with (
        hung_listener() as hung,
        Channel(
            f"127.0.0.1:{hung.port}", ssl_context=tls_files.client_context(), connect_timeout=0.2
        ) as channel,
    ):
        with anyio.fail_after(2), pytest.raises(RpcError) as caught:
            await channel.unary_stream(METHOD)(b"x").read()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "TLS handshake" in (caught.value.details() or "")


async def test_connect_timeout_none_waits_for_the_call_deadline() -> None:
    async with (
        hung_listener() as hung,
        Channel(f"127.0.0.1:{hung.port}", connect_timeout=None) as channel,
    ):
        with anyio.fail_after(5), pytest.raises(RpcError) as caught:
            await channel.unary_unary(METHOD)(b"x", timeout=0.2)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1, ValueError), (math.nan, ValueError), (math.inf, ValueError),
     ("5", TypeError), (True, TypeError)],
)  # fmt: skip
def test_bad_connect_timeouts_are_refused(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="connect_timeout"):
        Channel("127.0.0.1:80", connect_timeout=value)  # type: ignore[arg-type]


# -- frames after our own GOAWAY -----------------------------------------------------------


def server_frames(*, goaway: bool) -> bytes:
    """What a server sends right after accepting: SETTINGS, a PING, maybe its own GOAWAY."""
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    server.initiate_connection()
    server.ping(b"12345678")
    data = server.data_to_send()
    if goaway:
        server.close_connection()
        data += server.data_to_send()
    return data


@pytest.mark.parametrize("goaway", [False, True])
async def test_frames_after_our_goaway_are_dropped(goaway: bool) -> None:
    received = bytearray()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    ended = anyio.Event()

    async def take(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                while True:
                    received.extend(await stream.receive())
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
        ended.set()

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, take)
        channel = Channel(f"127.0.0.1:{port}")
        conn = await channel._connect()  # not run: the test plays its reader
        conn.close()  # our GOAWAY (h2 is now CLOSED)
        # The server's SETTINGS (and more) arrive after it, as they may on the wire.
        assert conn._received(server_frames(goaway=goaway))
        assert conn._failure is None
        assert conn.h2.data_to_send() == b""
        await anyio.aclose_forcefully(conn._byte_stream)
        with anyio.fail_after(5):
            await ended.wait()
        tg.cancel_scope.cancel()
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    events = server.receive_data(bytes(received))
    goaways = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert [e.error_code for e in goaways] == [ErrorCodes.NO_ERROR]


async def test_closing_before_the_servers_settings_sends_one_goaway() -> None:
    # A server that holds its SETTINGS back until the client's GOAWAY arrives,
    # then sends them (and a PING): the client closes cleanly, every time.
    codes: list[int] = []

    async def serve(stream: anyio.abc.SocketStream) -> None:
        server = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        async with stream:
            try:
                while True:
                    events = server.receive_data(await stream.receive())
                    for event in events:
                        if isinstance(event, h2.events.ConnectionTerminated):
                            codes.append(event.error_code or 0)
                    if any(isinstance(e, h2.events.ConnectionTerminated) for e in events):
                        await stream.send(server_frames(goaway=False))
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            except h2.exceptions.ProtocolError:
                codes.append(-1)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        for _ in range(10):
            async with Channel(f"127.0.0.1:{port}") as channel:
                await channel.connection()
        with anyio.fail_after(5):
            while len(codes) < 10:  # noqa: ASYNC110 - the server's record has no event
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert codes == [ErrorCodes.NO_ERROR] * 10
