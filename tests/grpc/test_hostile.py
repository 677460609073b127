"""Servers that misbehave (tests/grpc/support.py): each gives a typed error, in time, cleanly.

For every scenario: the call raises ``RpcError`` with the code the spec (or
common sense) says, within the call's deadline (``fail_after`` is 10x that
deadline or more), the client resets what it abandons, and no task of the
channel outlives the call beyond its connection's own three.
"""

from __future__ import annotations

import gzip
import struct
from typing import Any

import anyio
import grpc
import h2.connection
import h2.events
import h2.settings
import pytest
from h2.errors import ErrorCodes

from nadisc.grpc import Channel, RpcError

from .support import Conn, grpc_tasks, h2_server

METHOD = "/hostile.Service/Call"


async def wait_for(predicate: Any) -> None:
    """Until ``predicate()`` holds (what the server saw), at most 5 s."""
    with anyio.fail_after(5):
        while not predicate():  # noqa: ASYNC110 - the server's record has no event
            await anyio.sleep(0.01)


def reset_seen(server: Any) -> Any:
    return lambda: (1, ErrorCodes.CANCEL) in server.record.resets


def frame(payload: bytes, flag: int = 0) -> bytes:
    return struct.pack(">BI", flag, len(payload)) + payload


async def call_unary(
    port: int, deadline: float = 2.0, *, then: Any = None, **kwargs: Any
) -> RpcError:
    """The error of one unary call; ``then()`` is awaited while the channel is still open."""
    async with Channel(f"127.0.0.1:{port}", **kwargs) as channel:
        with anyio.fail_after(deadline * 10), pytest.raises(RpcError) as caught:
            await channel.unary_unary(METHOD)(b"ping", timeout=deadline)
        assert grpc_tasks() <= 3  # reader, writer, keepalive of the connection at most
        if then is not None:
            await then()
    return caught.value


async def on_request(conn: Conn, event: h2.events.Event, answer: Any) -> None:
    if isinstance(event, h2.events.StreamEnded):
        await answer(conn, event.stream_id)


async def test_no_trailers() -> None:
    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        await conn.data(sid, frame(b"pong"), end=True)

    async with h2_server(lambda c, e: on_request(c, e, answer)) as server:
        error = await call_unary(server.port)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "trailers" in (error.details() or "")


async def test_malformed_prefix() -> None:
    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        await conn.data(sid, b"\x07\x00\x00\x00\x01x")

    async with h2_server(lambda c, e: on_request(c, e, answer)) as server:
        error = await call_unary(
            server.port,
            then=lambda: wait_for(lambda: (1, ErrorCodes.CANCEL) in server.record.resets),
        )
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "compressed flag 7" in (error.details() or "")


async def test_stream_ends_inside_a_message() -> None:
    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        await conn.data(sid, b"\x00\x00\x00\x00\x09abc")
        await conn.trailers(sid)

    async with h2_server(lambda c, e: on_request(c, e, answer)) as server:
        error = await call_unary(server.port)
    assert error.code() == grpc.StatusCode.INTERNAL


async def test_four_gib_declared_message_is_refused_at_the_prefix() -> None:
    sent: list[int] = []

    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        # The most a 4-byte length can say, then as much body as the window takes.
        await conn.data(sid, struct.pack(">BI", 0, 0xFFFFFFFF))
        chunk = b"\0" * 16384
        while conn.h2.local_flow_control_window(sid) >= len(chunk):
            try:
                await conn.data(sid, chunk)
            except Exception:
                return
            sent.append(len(chunk))

    async with h2_server(lambda c, e: on_request(c, e, answer)) as server:
        error = await call_unary(
            server.port,
            then=lambda: wait_for(lambda: (1, ErrorCodes.CANCEL) in server.record.resets),
        )
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4294967295-byte" in (error.details() or "")
    # What the server could push is bounded by the windows the client gave.
    assert sum(sent) <= 8 * 1024 * 1024


async def test_gzip_bomb_is_refused_at_the_limit() -> None:
    bomb = gzip.compress(b"\0" * (5 * 1024 * 1024))

    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(
            sid,
            [
                (b":status", b"200"),
                (b"content-type", b"application/grpc"),
                (b"grpc-encoding", b"gzip"),
            ],
        )
        await conn.data(sid, frame(bomb, flag=1))
        await conn.trailers(sid)

    async with h2_server(lambda c, e: on_request(c, e, answer)) as server:
        error = await call_unary(server.port)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "inflated" in (error.details() or "")


async def test_endless_stream_gets_no_credit_past_the_window() -> None:
    pushed: list[int] = []

    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        message = frame(b"\1" * 16000)
        while True:
            window = conn.h2.local_flow_control_window(sid)
            if window < len(message):
                # Wait for credit that a reader who stopped reading never gives.
                conn.state["stalled"] = True
                return
            await conn.data(sid, message)
            pushed.append(len(message))

    async with (
        h2_server(lambda c, e: on_request(c, e, answer)) as server,
        Channel(f"127.0.0.1:{server.port}", stream_window=256 * 1024) as channel,
    ):
        call = channel.unary_stream(METHOD)(b"go", timeout=0.5)
        with anyio.fail_after(10), pytest.raises(RpcError) as caught:
            async for _ in call:
                await anyio.sleep(1)  # a reader that stops after one message
        assert grpc_tasks() <= 3
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The server never got past the client's 256 KiB stream window.
    assert 0 < sum(pushed) <= 256 * 1024 + 16005


async def test_no_flow_control_credit_for_the_request() -> None:
    async def silent(conn: Conn, event: h2.events.Event) -> None:
        return None

    settings: dict[int, int] = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
    async with h2_server(silent, settings=settings) as server:
        async with Channel(f"127.0.0.1:{server.port}") as channel:
            with anyio.fail_after(5), pytest.raises(RpcError) as caught:
                await channel.unary_unary(METHOD)(b"x" * 100_000, timeout=0.3)
            assert grpc_tasks() <= 3
        await wait_for(lambda: (1, ErrorCodes.CANCEL) in server.record.resets)
        # Before the server's SETTINGS arrive HTTP/2's default 65,535-byte
        # window applies; nothing past it was sent, and the request never ended.
        assert len(server.record.data.get(1, b"")) <= 65535
        assert 1 not in server.record.ended
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_stalled_connection() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def accept_and_ignore(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await anyio.sleep_forever()

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, accept_and_ignore)
        error = await call_unary(port, 0.3)
        tg.cancel_scope.cancel()
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_goaway_before_processing_is_retried_on_a_new_connection() -> None:
    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if not isinstance(event, h2.events.StreamEnded):
            return
        sid = event.stream_id or 0
        if conn.number == 1:
            conn.h2.close_connection(last_stream_id=0)
            await conn.flush()
            return
        await conn.respond(sid)
        await conn.data(sid, frame(b"pong"))
        await conn.trailers(sid)

    async with h2_server(scenario) as server:
        async with Channel(f"127.0.0.1:{server.port}") as channel:
            with anyio.fail_after(10):
                assert await channel.unary_unary(METHOD)(b"ping", timeout=1) == b"pong"
        assert server.record.connections == 2


async def test_goaway_mid_call_then_close_is_unavailable() -> None:
    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id or 0
            await conn.respond(sid)
            conn.h2.close_connection(last_stream_id=sid)
            await conn.flush()
            await conn.stream.aclose()

    async with h2_server(scenario) as server:
        error = await call_unary(server.port)
    assert error.code() == grpc.StatusCode.UNAVAILABLE


async def test_goaway_lets_processed_streams_finish() -> None:
    """Streams at or below last_stream_id complete on the draining connection."""

    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id or 0
            await conn.respond(sid)
            conn.h2.close_connection(last_stream_id=sid)
            # h2 stops its own server side at GOAWAY too; RFC 9113 lets it finish.
            conn.h2.state_machine.state = h2.connection.ConnectionState.SERVER_OPEN
            await conn.flush()
            await conn.data(sid, frame(b"late"))
            await conn.trailers(sid)

    async with h2_server(scenario) as server:
        async with Channel(f"127.0.0.1:{server.port}") as channel:
            with anyio.fail_after(10):
                assert await channel.unary_unary(METHOD)(b"ping", timeout=1) == b"late"
                # The next call goes to a new connection.
                assert await channel.unary_unary(METHOD)(b"ping", timeout=1) == b"late"
        assert server.record.connections == 2


async def test_streaming_request_is_not_retried_after_goaway() -> None:
    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            conn.h2.close_connection(last_stream_id=0)
            await conn.flush()

    async with h2_server(scenario) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        with anyio.fail_after(10), pytest.raises(RpcError) as caught:
            await channel.stream_unary(METHOD)(iter([b"a", b"b"]), timeout=1)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_too_many_pings_backs_off() -> None:
    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.PingReceived) and conn.number == 1:
            conn.h2.close_connection(
                error_code=ErrorCodes.ENHANCE_YOUR_CALM,
                additional_data=b"too_many_pings",
                last_stream_id=0,
            )
            await conn.flush()
        elif isinstance(event, h2.events.StreamEnded) and conn.number == 2:
            sid = event.stream_id or 0
            await conn.respond(sid)
            await conn.data(sid, frame(b"pong"))
            await conn.trailers(sid)

    async with (
        h2_server(scenario) as server,
        Channel(
            f"127.0.0.1:{server.port}", keepalive_time=0.05, keepalive_without_calls=True
        ) as channel,
    ):
        with anyio.fail_after(10):
            await channel.connection()
            await wait_for(lambda: server.record.pings > 0)
            await wait_for(lambda: channel._conn is None or not channel._conn.usable)
            assert await channel.unary_unary(METHOD)(b"ping", timeout=2) == b"pong"
        assert channel.keepalive_time == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("http_status", "code"),
    [
        (b"400", grpc.StatusCode.INTERNAL),
        (b"401", grpc.StatusCode.UNAUTHENTICATED),
        (b"403", grpc.StatusCode.PERMISSION_DENIED),
        (b"404", grpc.StatusCode.UNIMPLEMENTED),
        (b"429", grpc.StatusCode.UNAVAILABLE),
        (b"502", grpc.StatusCode.UNAVAILABLE),
        (b"503", grpc.StatusCode.UNAVAILABLE),
        (b"504", grpc.StatusCode.UNAVAILABLE),
        (b"500", grpc.StatusCode.UNKNOWN),
    ],
)
async def test_http_status_mapping(http_status: bytes, code: grpc.StatusCode) -> None:
    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(
            sid, [(b":status", http_status), (b"content-type", b"text/html")], end=True
        )

    async with h2_server(lambda c, e: on_request(c, e, answer)) as server:
        error = await call_unary(server.port)
    assert error.code() == code


async def test_trailers_only_response() -> None:
    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(
            sid,
            [
                (b":status", b"200"),
                (b"content-type", b"application/grpc"),
                (b"grpc-status", b"5"),
                (b"grpc-message", b"no%20such%20thing%20%E2%98%BA"),
                (b"x-extra-bin", b"q6ur"),
            ],
            end=True,
        )

    async with h2_server(lambda c, e: on_request(c, e, answer)) as server:
        error = await call_unary(server.port)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == "no such thing \u263a"
    assert error.trailing_metadata()["x-extra-bin"] == b"\xab\xab\xab"


async def test_oversized_server_metadata() -> None:
    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(
            sid,
            [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"x-big", b"a" * 9000)],
        )

    async with h2_server(lambda c, e: on_request(c, e, answer)) as server:
        error = await call_unary(server.port)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_compressed_request_and_metadata_on_the_wire() -> None:
    """The interop expect_compressed check: flag 1 and grpc-encoding on a gzip call."""

    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        await conn.data(sid, frame(b"ok"))
        await conn.trailers(sid)

    async with h2_server(lambda c, e: on_request(c, e, answer)) as server:
        async with Channel(f"127.0.0.1:{server.port}") as channel:
            method = channel.unary_unary(METHOD)
            await method(b"z" * 1000, compression=grpc.Compression.Gzip, timeout=2)
            await method(
                b"plain",
                timeout=2,
                metadata=(("x-text", "v"), ("x-raw-bin", b"\x00\xff")),
            )
        (_, first), (_, second) = server.record.requests
        assert first[b"grpc-encoding"] == b"gzip"
        assert b"grpc-encoding" not in second
        assert second[b"x-raw-bin"] == b"AP8"
        assert second[b"x-text"] == b"v"
        assert first[b"te"] == b"trailers" and first[b"content-type"] == b"application/grpc"
        assert b"grpc-timeout" in first
        body = bytes(server.record.data[1])
        assert body[0] == 1 and gzip.decompress(body[5:]) == b"z" * 1000
        assert bytes(server.record.data[3]) == frame(b"plain")


async def test_send_limit_sends_nothing() -> None:
    async def silent(conn: Conn, event: h2.events.Event) -> None:
        return None

    async with h2_server(silent) as server:
        async with Channel(f"127.0.0.1:{server.port}", max_send_message_length=1000) as channel:
            with pytest.raises(RpcError) as caught:
                await channel.unary_unary(METHOD)(b"x" * 1001)
        assert server.record.requests == []
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "metadata",
    [
        (("grpc-timeout", "1S"),),
        (("content-type", "text/plain"),),
        ((":path", "/x"),),
        (("Upper", "x"),),
        (("x-bin", "not bytes"),),
        (("x-text", "line\nbreak"),),
        (("x-big", "a" * 9000),),
    ],
)
async def test_bad_metadata_is_refused(metadata: Any) -> None:
    async with Channel("127.0.0.1:1") as channel:
        with pytest.raises(ValueError, match="metadata"):
            channel.unary_unary(METHOD)(b"", metadata=metadata)


async def test_timeout_header_carries_the_enclosing_deadline() -> None:
    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        await conn.data(sid, frame(b"ok"))
        await conn.trailers(sid)

    async with h2_server(lambda c, e: on_request(c, e, answer)) as server:
        async with Channel(f"127.0.0.1:{server.port}") as channel:
            with anyio.move_on_after(30):
                await channel.unary_unary(METHOD)(b"", timeout=60)
            await channel.unary_unary(METHOD)(b"", timeout=5)
        (_, first), (_, second) = server.record.requests
    # Nested 30 s scope beats the 60 s timeout; the second call says 5 s.
    first_timeout = first[b"grpc-timeout"]
    second_timeout = second[b"grpc-timeout"]
    assert first_timeout.endswith(b"u") and 25e6 < int(first_timeout[:-1]) <= 30e6
    assert second_timeout.endswith(b"u") and 4e6 < int(second_timeout[:-1]) <= 5e6


async def test_an_error_in_the_channel_body_is_not_wrapped() -> None:
    with pytest.raises(KeyError):
        async with Channel("127.0.0.1:1"):
            raise KeyError("mine")


async def test_channel_not_entered_or_closed_is_unavailable() -> None:
    channel = Channel("127.0.0.1:1")
    with pytest.raises(RpcError) as caught:
        await channel.unary_unary(METHOD)(b"")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    async with channel:
        pass
    await channel.close()  # twice is fine
    with pytest.raises(RpcError):
        await channel.unary_unary(METHOD)(b"")


async def test_connection_refused_is_unavailable() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    async with Channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(RpcError) as caught:
            await channel.unary_unary(METHOD)(b"", timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert str(port) in (caught.value.details() or "")


@pytest.mark.parametrize("target", ["nohost", "host:", "host:99999", "[::1:5", ":80"])
def test_bad_targets_are_refused(target: str) -> None:
    with pytest.raises(ValueError, match="target"):
        Channel(target)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_bad_transparent_retries_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match="transparent_retries"):
        Channel("127.0.0.1:80", transparent_retries=value)  # type: ignore[arg-type]


async def test_unanswered_keepalive_fails_the_calls() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def accept_and_ignore(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await anyio.sleep_forever()

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, accept_and_ignore)
        async with Channel(
            f"127.0.0.1:{port}", keepalive_time=0.1, keepalive_timeout=0.2
        ) as channel:
            with anyio.fail_after(10), pytest.raises(RpcError) as caught:
                await channel.unary_unary(METHOD)(b"no deadline")
        tg.cancel_scope.cancel()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "keepalive" in (caught.value.details() or "")


async def test_max_concurrent_streams_queues_calls() -> None:
    open_now: set[int] = set()
    most: list[int] = [0]

    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            open_now.add(event.stream_id or 0)
            most[0] = max(most[0], len(open_now))
        elif isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id or 0
            await anyio.sleep(0.01)
            await conn.respond(sid)
            await conn.data(sid, frame(b"done"))
            await conn.trailers(sid)
            open_now.discard(sid)

    settings: dict[int, int] = {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 2}
    results: list[bytes] = []
    async with h2_server(scenario, settings=settings) as server:
        async with Channel(f"127.0.0.1:{server.port}") as channel:
            method = channel.unary_unary(METHOD)
            await method(b"first", timeout=5)  # the server's SETTINGS have arrived

            async def one() -> None:
                results.append(await method(b"x", timeout=5))

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    for _ in range(8):
                        tg.start_soon(one)
        assert server.record.connections == 1
    assert results == [b"done"] * 8
    assert most[0] <= 2


async def test_abandoned_streaming_call_is_reset_when_collected() -> None:
    import gc

    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        await conn.data(sid, frame(b"one") + frame(b"two"))

    async with (
        h2_server(lambda c, e: on_request(c, e, answer)) as server,
        Channel(f"127.0.0.1:{server.port}") as channel,
    ):
        call = channel.unary_stream(METHOD)(b"go", timeout=10)
        assert await call.read() == b"one"
        del call  # broken out of, never cancelled
        gc.collect()
        await wait_for(reset_seen(server))
        conn = await channel.connection()
        assert conn.streams == {}
