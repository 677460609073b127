"""Servers that misbehave (tests/grpc/support.py): each gives a typed error, in time, cleanly.

For every scenario (:func:`hostile_call` runs it): the call raises
``RpcError`` with the code the spec (or common sense) says, within the call's
deadline (``fail_after`` is 10x that deadline), the client resets what it
abandons (``reset=True``), and no task of the channel outlives the call
beyond its connection's own three. Rows that push data also bound what the
server could push.
"""

from __future__ import annotations

import gzip
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import grpc
import h2.connection
import h2.events
import h2.settings
import pytest
from h2.errors import ErrorCodes

from nadisc.grpc import Channel, RpcError

from .support import Conn, Record, Scenario, frame, grpc_tasks, h2_server

METHOD = "/hostile.Service/Call"


async def wait_for(predicate: Any) -> None:
    """Until ``predicate()`` holds (what the server saw), at most 5 s."""
    with anyio.fail_after(5):
        while not predicate():  # noqa: ASYNC110 - the server's record has no event
            await anyio.sleep(0.01)


#: Answers one request once the client ended it: ``answer(conn, stream_id)``.
Answer = Callable[[Conn, int], Awaitable[None]]
#: Makes the call of a row on the channel, with the deadline (seconds).
CallOf = Callable[[Channel, float], Awaitable[Any]]


async def unary_ping(channel: Channel, deadline: float) -> Any:
    return await channel.unary_unary(METHOD)(b"ping", timeout=deadline)


async def answer_ok(conn: Conn, sid: int) -> None:
    await conn.respond(sid)
    await conn.data(sid, frame(b"ok"))
    await conn.trailers(sid)


async def on_request(conn: Conn, event: h2.events.Event, answer: Answer) -> None:
    if isinstance(event, h2.events.StreamEnded):
        await answer(conn, event.stream_id or 0)


@asynccontextmanager
async def silent_tcp() -> AsyncIterator[int]:
    """A TCP server that accepts connections and never says a byte; yields its port."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")

    async def accept_and_ignore(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await anyio.sleep_forever()

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, accept_and_ignore)
        yield listener.extra(anyio.abc.SocketAttribute.local_port)
        tg.cancel_scope.cancel()


@asynccontextmanager
async def serving(
    answer: Answer | None = None,
    *,
    scenario: Scenario | None = None,
    settings: dict[int, int] | None = None,
    **options: Any,
) -> AsyncIterator[tuple[Channel, Record]]:
    """A channel to a server that answers each request with ``answer``, or runs
    ``scenario`` on every event, or (neither) never speaks; and what it saw.
    """
    async with AsyncExitStack() as stack:
        if answer is None and scenario is None:
            port, record = await stack.enter_async_context(silent_tcp()), Record()
        else:

            async def per_request(conn: Conn, event: h2.events.Event) -> None:
                assert answer is not None
                await on_request(conn, event, answer)

            server = await stack.enter_async_context(
                h2_server(scenario or per_request, settings=settings)
            )
            port, record = server.port, server.record
        channel = await stack.enter_async_context(Channel(f"127.0.0.1:{port}", **options))
        yield channel, record


async def hostile_call(
    answer: Answer | None = None,
    *,
    scenario: Scenario | None = None,
    call: CallOf = unary_ping,
    deadline: float = 2.0,
    reset: bool = False,
    settings: dict[int, int] | None = None,
    **options: Any,
) -> tuple[RpcError, Record]:
    """One row: ``call`` against the misbehaving server (see :func:`serving`).

    It must raise ``RpcError`` within ten times ``deadline``, leave at most
    the connection's own tasks behind and, with ``reset``, RST_STREAM(CANCEL)
    the stream it gave up, while the channel is still open.
    """
    async with serving(answer, scenario=scenario, settings=settings, **options) as (
        channel,
        record,
    ):
        with anyio.fail_after(deadline * 10), pytest.raises(RpcError) as caught:
            await call(channel, deadline)
        assert grpc_tasks() <= 3  # reader, writer, keepalive of the connection at most
        if reset:
            await wait_for(lambda: (1, ErrorCodes.CANCEL) in record.resets)
    return caught.value, record


async def test_no_trailers() -> None:
    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        await conn.data(sid, frame(b"pong"), end=True)

    error, _ = await hostile_call(answer)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "trailers" in (error.details() or "")


async def test_malformed_prefix() -> None:
    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        await conn.data(sid, b"\x07\x00\x00\x00\x01x")

    error, _ = await hostile_call(answer, reset=True)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "compressed flag 7" in (error.details() or "")


async def test_stream_ends_inside_a_message() -> None:
    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        await conn.data(sid, b"\x00\x00\x00\x00\x09abc")
        await conn.trailers(sid)

    error, _ = await hostile_call(answer)
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

    error, _ = await hostile_call(answer, reset=True)
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

    error, _ = await hostile_call(answer)
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

    async def slow_reader(channel: Channel, deadline: float) -> None:
        async for _ in channel.unary_stream(METHOD)(b"go", timeout=deadline):
            await anyio.sleep(1)  # a reader that stops after one message

    error, _ = await hostile_call(answer, call=slow_reader, deadline=0.5, stream_window=256 * 1024)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The server never got past the client's 256 KiB stream window.
    assert 0 < sum(pushed) <= 256 * 1024 + 16005


async def silent(conn: Conn, event: h2.events.Event) -> None:
    return None


async def test_no_flow_control_credit_for_the_request() -> None:
    async def large(channel: Channel, deadline: float) -> None:
        await channel.unary_unary(METHOD)(b"x" * 100_000, timeout=deadline)

    settings: dict[int, int] = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
    error, record = await hostile_call(
        scenario=silent, settings=settings, call=large, deadline=0.3, reset=True
    )
    # Before the server's SETTINGS arrive HTTP/2's default 65,535-byte
    # window applies; nothing past it was sent, and the request never ended.
    assert len(record.data.get(1, b"")) <= 65535
    assert 1 not in record.ended
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_stalled_connection() -> None:
    error, _ = await hostile_call(deadline=0.3)
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

    async with serving(scenario=scenario) as (channel, record):
        with anyio.fail_after(10):
            assert await channel.unary_unary(METHOD)(b"ping", timeout=1) == b"pong"
    assert record.connections == 2


async def test_goaway_mid_call_then_close_is_unavailable() -> None:
    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id or 0
            await conn.respond(sid)
            conn.h2.close_connection(last_stream_id=sid)
            await conn.flush()
            await conn.stream.aclose()

    error, _ = await hostile_call(scenario=scenario)
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

    async with serving(scenario=scenario) as (channel, record):
        with anyio.fail_after(10):
            assert await channel.unary_unary(METHOD)(b"ping", timeout=1) == b"late"
            # The next call goes to a new connection.
            assert await channel.unary_unary(METHOD)(b"ping", timeout=1) == b"late"
    assert record.connections == 2


async def test_streaming_request_is_not_retried_after_goaway() -> None:
    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            conn.h2.close_connection(last_stream_id=0)
            await conn.flush()

    async def two_requests(channel: Channel, deadline: float) -> None:
        await channel.stream_unary(METHOD)(iter([b"a", b"b"]), timeout=deadline)

    error, record = await hostile_call(scenario=scenario, call=two_requests, deadline=1)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert record.connections == 1


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

    async with serving(scenario=scenario, keepalive_time=0.05, keepalive_without_calls=True) as (
        channel,
        record,
    ):
        with anyio.fail_after(10):
            await channel.connection()
            await wait_for(lambda: record.pings > 0)
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

    error, _ = await hostile_call(answer)
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

    error, _ = await hostile_call(answer)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == "no such thing \u263a"
    assert error.trailing_metadata()["x-extra-bin"] == b"\xab\xab\xab"


async def test_oversized_server_metadata() -> None:
    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(
            sid,
            [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"x-big", b"a" * 9000)],
        )

    error, _ = await hostile_call(answer)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_compressed_request_and_metadata_on_the_wire() -> None:
    """The interop expect_compressed check: flag 1 and grpc-encoding on a gzip call."""

    async with serving(answer_ok) as (channel, record):
        method = channel.unary_unary(METHOD)
        await method(b"z" * 1000, compression=grpc.Compression.Gzip, timeout=2)
        await method(
            b"plain",
            timeout=2,
            metadata=(("x-text", "v"), ("x-raw-bin", b"\x00\xff")),
        )
        (_, first), (_, second) = record.requests
        assert first[b"grpc-encoding"] == b"gzip"
        assert b"grpc-encoding" not in second
        assert second[b"x-raw-bin"] == b"AP8"
        assert second[b"x-text"] == b"v"
        assert first[b"te"] == b"trailers" and first[b"content-type"] == b"application/grpc"
        assert b"grpc-timeout" in first
        body = bytes(record.data[1])
        assert body[0] == 1 and gzip.decompress(body[5:]) == b"z" * 1000
        assert bytes(record.data[3]) == frame(b"plain")


async def test_send_limit_sends_nothing() -> None:
    async def oversized(channel: Channel, deadline: float) -> None:
        await channel.unary_unary(METHOD)(b"x" * 1001)

    error, record = await hostile_call(
        scenario=silent, call=oversized, max_send_message_length=1000
    )
    assert record.requests == []
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


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
    async with serving(answer_ok) as (channel, record):
        with anyio.move_on_after(30):
            await channel.unary_unary(METHOD)(b"", timeout=60)
        await channel.unary_unary(METHOD)(b"", timeout=5)
        (_, first), (_, second) = record.requests
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


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)]
)
def test_bad_transparent_retries_are_refused(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="transparent_retries"):
        Channel("127.0.0.1:80", transparent_retries=value)  # type: ignore[arg-type]


async def test_unanswered_keepalive_fails_the_calls() -> None:
    async def no_deadline(channel: Channel, deadline: float) -> None:
        await channel.unary_unary(METHOD)(b"no deadline")

    # The keepalive (0.1 s, then 0.2 s for the answer) ends it; 10 s is the bound.
    error, _ = await hostile_call(
        call=no_deadline, deadline=1.0, keepalive_time=0.1, keepalive_timeout=0.2
    )
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "keepalive" in (error.details() or "")


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
    async with serving(scenario=scenario, settings=settings) as (channel, record):
        method = channel.unary_unary(METHOD)
        await method(b"first", timeout=5)  # the server's SETTINGS have arrived

        async def one() -> None:
            results.append(await method(b"x", timeout=5))

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(one)
    assert record.connections == 1
    assert results == [b"done"] * 8
    assert most[0] <= 2


async def test_abandoned_streaming_call_is_reset_when_collected() -> None:
    import gc

    async def answer(conn: Conn, sid: int) -> None:
        await conn.respond(sid)
        await conn.data(sid, frame(b"one") + frame(b"two"))

    async with serving(answer) as (channel, record):
        call = channel.unary_stream(METHOD)(b"go", timeout=10)
        assert await call.read() == b"one"
        del call  # broken out of, never cancelled
        gc.collect()
        await wait_for(lambda: (1, ErrorCodes.CANCEL) in record.resets)
        conn = await channel.connection()
        assert conn.streams == {}


async def test_a_connection_closed_right_after_the_answer_keeps_the_answer() -> None:
    # Headers, message and trailers in one write, then the server closes the
    # connection: the call already has its whole answer, and it is an answer,
    # not UNAVAILABLE "the connection closed" (grpcio's client agrees).
    async def answer_and_close(conn: Conn, sid: int) -> None:
        conn.h2.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
        conn.h2.send_data(sid, frame(b"pong"))
        conn.h2.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
        await conn.stream.send(conn.h2.data_to_send())
        await conn.stream.aclose()

    for _ in range(20):
        async with serving(answer_and_close) as (channel, record):
            with anyio.fail_after(20):
                assert await unary_ping(channel, 2.0) == b"pong"
            assert record.connections == 1


async def test_a_server_that_sends_goaway_on_every_connection_is_unavailable() -> None:
    # Every connection goes away (last stream id 0) as soon as the client's
    # preface arrives, so no stream is ever processed. A call with no
    # deadline still ends, with UNAVAILABLE, after the transparent retries:
    # one connection for the call and one for each retry.
    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RemoteSettingsChanged) and not conn.state:
            conn.state["gone"] = True
            conn.h2.close_connection(last_stream_id=0)
            await conn.flush()

    async with serving(scenario=scenario) as (channel, record):
        with anyio.fail_after(10), pytest.raises(RpcError) as caught:
            await channel.unary_unary(METHOD)(b"ping")
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "GOAWAY before processing" in (caught.value.details() or "")
        assert record.connections == 1 + channel.transparent_retries


@pytest.mark.parametrize("target", ["127.0.0.1:\u00b2", "127.0.0.1:\u0664\u0664", "[::1]:\u00b9"])
def test_a_target_whose_port_has_non_ascii_digits_is_refused(target: str) -> None:
    # str.isdigit() accepts superscripts and other scripts' digits, which
    # int() then refuses: the channel's own error, not int()'s.
    with pytest.raises(ValueError, match="has no valid port"):
        Channel(target)
