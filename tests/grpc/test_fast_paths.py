"""The channel's per-call shortcuts keep the wire what it was (tests/grpc/support.py server).

- The fixed request headers are HPACK-encoded once per multicallable with no
  dynamic-table use, so the block means the same on any connection, at any
  point of its compression state.
- Frames are sent from the calling task on plaintext connections (asyncio's
  transport, trio's non-blocking socket); closed streams do not pile up in
  ``h2``; a server's change of SETTINGS_HEADER_TABLE_SIZE is honoured.
- A streaming reader takes messages already received without waiting, and a
  deserializer's own ``None`` is a message like any other.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import grpc
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
import pytest

from nadisc.grpc import Channel, RpcError
from nadisc.grpc._channel import _TIMEOUT_LITERAL, _fixed_block

from .support import Conn, frame, h2_server

METHOD = "/fast.Service/Call"
HEADERS = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", METHOD.encode()),
    (b":authority", b"127.0.0.1:1"),
    (b"te", b"trailers"),
    (b"content-type", b"application/grpc"),
]


async def answer(conn: Conn, event: h2.events.Event) -> None:
    if isinstance(event, h2.events.StreamEnded):
        sid = event.stream_id or 0
        await conn.respond(sid)
        await conn.data(sid, frame(b"one") + frame(b"two") + frame(b"three"))
        await conn.trailers(sid)


def test_fixed_block_uses_no_dynamic_table_entry() -> None:
    block = _fixed_block(HEADERS) + _TIMEOUT_LITERAL + b"\x03" + b"20m"
    fresh = hpack.Decoder()
    assert fresh.decode(block, raw=True) == [*HEADERS, (b"grpc-timeout", b"20m")]
    assert len(fresh.header_table.dynamic_entries) == 0
    # A decoder that already holds entries reads the same block the same way.
    used = hpack.Decoder()
    used.decode(hpack.Encoder().encode([(b"x-a", b"1"), (b":path", b"/other")]), raw=True)
    entries = list(used.header_table.dynamic_entries)
    assert used.decode(block, raw=True) == [*HEADERS, (b"grpc-timeout", b"20m")]
    assert list(used.header_table.dynamic_entries) == entries


async def test_multicallables_of_one_method_share_their_encoded_headers() -> None:
    """Code that makes a multicallable per call (the etcd client does, as
    ``grpc.aio`` allows) encodes the fixed headers once per method and
    target, not per call; another method or target gets its own."""
    async with Channel("127.0.0.1:1") as one, Channel("127.0.0.1:2") as other:
        first = one.unary_unary("/pkg.Service/A")._fixed
        assert one.unary_stream("/pkg.Service/A")._fixed is first
        assert one.unary_unary("/pkg.Service/B")._fixed is not first
        assert other.unary_unary("/pkg.Service/A")._fixed is not first
        plain, gzip = first
        assert hpack.Decoder().decode(plain, raw=True) == [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/pkg.Service/A"),
            (b":authority", b"127.0.0.1:1"),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc"),
            (b"user-agent", b"nadisc-grpc/0.1"),
            (b"grpc-accept-encoding", b"identity,gzip"),
        ]
        assert list(hpack.Decoder().decode(gzip, raw=True))[-1] == (b"grpc-encoding", b"gzip")


async def test_plaintext_frames_go_out_from_the_calling_task() -> None:
    async with h2_server(answer) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        method = channel.unary_stream(METHOD)
        with anyio.fail_after(10):
            assert [m async for m in method(b"go", timeout=5)] == [b"one", b"two", b"three"]
        conn = await channel.connection()
        assert conn._send_now is not None
        assert conn._pending == b""
        (_, request) = server.record.requests[0]
        assert request[b":path"] == METHOD.encode() and request[b"te"] == b"trailers"
        assert bytes(server.record.data[1]) == frame(b"go")


async def test_closed_streams_are_dropped_from_h2() -> None:
    async with h2_server(answer) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        method = channel.unary_stream(METHOD)
        with anyio.fail_after(60):
            for _ in range(300):
                assert len([m async for m in method(b"go", timeout=5)]) == 3
        conn = await channel.connection()
        assert conn.streams == {}
        assert len(conn.h2.streams) < 200


async def test_metadata_after_the_server_shrinks_its_header_table() -> None:
    settings: dict[int, int] = {h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0}
    async with (
        h2_server(answer, settings=settings) as server,
        Channel(f"127.0.0.1:{server.port}") as channel,
    ):
        method = channel.unary_stream(METHOD)
        with anyio.fail_after(10):
            for value in ("a", "b", "a"):
                call = method(b"go", timeout=5, metadata=(("x-key", value),))
                assert len([m async for m in call]) == 3
        assert [r[b"x-key"] for _, r in server.record.requests] == [b"a", b"b", b"a"]
        assert all(b"grpc-timeout" in r for _, r in server.record.requests)


async def test_a_deserializer_returning_none_is_a_message() -> None:
    async with h2_server(answer) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        method = channel.unary_stream(METHOD, response_deserializer=lambda b: None)
        with anyio.fail_after(10):
            assert [m async for m in method(b"go", timeout=5)] == [None, None, None]


async def test_credit_comes_back_while_messages_are_read() -> None:
    """300 KB through a 64 KiB stream window: the server can only go on with credit."""
    total = 300
    message = frame(b"m" * 1000)

    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.StreamEnded):
            conn.state.update(sid=event.stream_id or 0, sent=0)
            await conn.respond(conn.state["sid"])
        elif not isinstance(event, h2.events.WindowUpdated) or "sid" not in conn.state:
            return
        sid = conn.state["sid"]
        while conn.state["sent"] < total and conn.h2.local_flow_control_window(sid) >= len(message):
            conn.h2.send_data(sid, message)
            conn.state["sent"] += 1
        if conn.state["sent"] == total and not conn.state.get("ended"):
            conn.state["ended"] = True
            await conn.trailers(sid)
        await conn.flush()

    async with (
        h2_server(scenario) as server,
        Channel(f"127.0.0.1:{server.port}", stream_window=65535) as channel,
    ):
        with anyio.fail_after(20):
            got = [m async for m in channel.unary_stream(METHOD)(b"go", timeout=10)]
        assert len(got) == total and got[0] == b"m" * 1000


async def test_a_written_stream_unary_call_keeps_its_response_for_every_await() -> None:
    async with h2_server(answer) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        method = channel.stream_unary(METHOD)
        with anyio.fail_after(10):
            call = method(timeout=5)
            await call.write(b"a")
            await call.done_writing()
            # The server answers three messages: more than one is INTERNAL, every time.
            code = await call.code()
            assert code == grpc.StatusCode.INTERNAL
            for _ in range(2):
                with pytest.raises(RpcError) as caught:
                    await call
                assert caught.value.code() == code
        assert bytes(server.record.data[1]) == frame(b"a")


async def test_code_before_the_await_of_a_written_call_keeps_the_response() -> None:
    async def one(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id or 0
            await conn.respond(sid)
            await conn.data(sid, frame(b"only"))
            await conn.trailers(sid)

    async with h2_server(one) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        with anyio.fail_after(10):
            call = channel.stream_unary(METHOD)(timeout=5)
            await call.write(b"a")
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            assert await call == b"only"
            assert await call == b"only"


def test_received_frames_are_not_formatted() -> None:
    """h2 formats every received frame for a trace line nothing reads; ours does not."""
    import h2.config
    import h2.connection
    import hyperframe.frame

    from nadisc.grpc._connection import client_h2

    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    server.initiate_connection()
    client = client_h2(stream_window=65535, connection_window=65535, max_header_list=16384)
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    block = _fixed_block(HEADERS)
    client.send_header_block(1, block, authority=b"127.0.0.1:1", end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    server.send_data(1, frame(b"one"))
    server.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    answer = server.data_to_send()

    def refuse(self: object) -> str:
        raise AssertionError("a received frame was formatted")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hyperframe.frame.Frame, "__repr__", refuse)
        events = client.receive_data(answer)
    kinds = [type(e) for e in events]
    assert kinds[:2] == [h2.events.SettingsAcknowledged, h2.events.ResponseReceived]
    assert h2.events.StreamEnded in kinds


async def test_the_reader_takes_bytes_from_the_socket_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader takes bytes with no extra task switch or transport pause.

    anyio's ``receive`` yields to the scheduler again after a trio read that
    found bytes waiting, and resumes and pauses an asyncio transport around
    every read. The reader reads trio's socket itself and has asyncio's
    transport hand its bytes over as they come: past the first call, anyio's
    ``receive`` is never entered again and the transport never paused.
    """
    from anyio._backends import _asyncio, _trio

    entered = 0
    ours: list[object] = []  # the client's stream (the test server's reads do not count)

    def counting(original: Any) -> Any:
        async def receive(self: Any, max_bytes: int = 65536) -> bytes:
            nonlocal entered
            entered += self in ours
            data: bytes = await original(self, max_bytes)
            return data

        return receive

    for module in (_asyncio, _trio):
        monkeypatch.setattr(module.SocketStream, "receive", counting(module.SocketStream.receive))
    async with h2_server(answer) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        method = channel.unary_stream(METHOD)
        with anyio.fail_after(10):
            assert len([m async for m in method(b"go", timeout=5)]) == 3
        conn = await channel.connection()
        ours.append(conn._byte_stream)
        reads = 0
        receive_data = conn.h2.receive_data

        def counted(data: bytes) -> list[h2.events.Event]:
            nonlocal reads
            reads += 1
            return receive_data(data)

        conn.h2.receive_data = counted  # type: ignore[method-assign]
        transport = getattr(conn._byte_stream, "_transport", None)
        paused = 0
        if transport is not None:
            pause = transport.pause_reading

            def counted_pause() -> None:
                nonlocal paused
                paused += 1
                pause()

            transport.pause_reading = counted_pause
        entered = 0
        with anyio.fail_after(10):
            for _ in range(20):
                assert len([m async for m in method(b"go", timeout=5)]) == 3
        assert reads >= 20
        assert (entered, paused) == (0, 0)


def _pair() -> tuple[Any, Any, Any]:
    """Our client h2, plain h2 with the same settings, and a server, past the preface."""
    import h2.config
    import h2.connection

    from nadisc.grpc._connection import _ClientH2, client_h2

    def ours() -> Any:
        return client_h2(stream_window=65535, connection_window=65535, max_header_list=65536)

    plain = ours()
    plain.__class__ = type("PlainClient", (_ClientH2,), {"receive_data": _PLAIN_RECEIVE})
    mine = ours()
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    server.initiate_connection()
    preface = mine.data_to_send()
    assert plain.data_to_send() == preface
    server.receive_data(preface)
    return mine, plain, server


#: h2's own receive_data (every frame through its FrameBuffer and _receive_frame).
_PLAIN_RECEIVE = h2.connection.H2Connection.receive_data


def _seen(events: list[h2.events.Event]) -> list[tuple[Any, ...]]:
    """The events as comparable values (h2's events have no equality)."""
    out: list[tuple[Any, ...]] = []
    for event in events:
        fields = {
            k: (bytes(v) if isinstance(v, memoryview) else v)
            for k, v in vars(event).items()
            if k not in ("stream_ended", "priority_updated", "changed_settings")
        }
        out.append((type(event).__name__, sorted(fields.items(), key=lambda kv: kv[0])))
    return out


def _outcome(client: Any, chunk: bytes) -> tuple[str, Any]:
    try:
        return "events", _seen(client.receive_data(chunk))
    except h2.exceptions.ProtocolError as exc:
        return "error", (type(exc).__name__, str(exc))


@pytest.mark.parametrize("seed", range(40))
def test_the_response_reader_agrees_with_h2(seed: int) -> None:
    """Random server traffic, cut at random points: the same events and the same
    frames to send as h2's own reader, padding, priority, CONTINUATION, resets,
    pings, GOAWAY and window updates included, and the same error for a frame
    over the size limit (priority added to a full HEADERS frame)."""
    import random

    import hyperframe.frame

    rng = random.Random(seed)
    mine, plain, server = _pair()
    block = _fixed_block(HEADERS)
    sids = [1, 3, 5, 7]
    for sid in sids:
        for client in (mine, plain):
            client.send_header_block(sid, block, authority=b"127.0.0.1:1", end_stream=True)
        sent = mine.data_to_send()
        assert plain.data_to_send() == sent
        server.receive_data(sent)
    wire = bytearray(server.data_to_send())
    for sid in sids:
        big = rng.random() < 0.3
        head = [(b":status", b"200"), (b"content-type", b"application/grpc")]
        if big:  # over one frame: HEADERS + CONTINUATION
            head.append((b"x-big", b"v" * 20000))
        server.send_headers(sid, head)
        if rng.random() < 0.3:  # h2 servers send no priority: add it to the frame
            sent = server.data_to_send()
            first, length = hyperframe.frame.Frame.parse_frame_header(memoryview(sent[:9]))
            first.parse_body(memoryview(sent[9 : 9 + length]))
            first.flags.add("PRIORITY")
            first.stream_weight = 16  # type: ignore[attr-defined]
            wire += first.serialize() + sent[9 + length :]
        for _ in range(rng.randrange(4)):
            server.send_data(
                sid, frame(b"m" * rng.randrange(200)), pad_length=rng.choice([None, 3])
            )
        if rng.random() < 0.2:
            server.send_data(sid, frame(b"last"), end_stream=True)  # DATA ends it
        elif rng.random() < 0.2:
            server.reset_stream(sid)
        else:
            server.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
        if rng.random() < 0.3:
            server.ping(b"12345678")
        if rng.random() < 0.3:
            server.increment_flow_control_window(100)
        wire += server.data_to_send()
    if rng.random() < 0.3:
        server.close_connection(last_stream_id=sids[-1])
        wire += server.data_to_send()
    cuts = sorted(rng.sample(range(1, len(wire)), min(8, len(wire) - 1)))
    for start, end in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        chunk = bytes(wire[start:end])
        assert _outcome(mine, chunk) == _outcome(plain, chunk)
        for sid in sids:  # credit, as the channel gives it back
            for client in (mine, plain):
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    client.acknowledge_received_data(0, sid)
        assert mine.data_to_send() == plain.data_to_send()


def test_response_frames_are_read_without_hyperframe() -> None:
    """A response's HEADERS, DATA and trailers are parsed by the channel's h2 reader."""
    import hyperframe.frame

    mine, _, server = _pair()
    mine.send_header_block(1, _fixed_block(HEADERS), authority=b"127.0.0.1:1", end_stream=True)
    server.receive_data(mine.data_to_send())
    server.send_headers(1, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    server.send_data(1, frame(b"one"))
    server.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    answer = server.data_to_send()  # SETTINGS and its ACK, then the response

    def refuse(self: object, data: object) -> None:
        raise AssertionError(f"hyperframe parsed a {type(self).__name__}")

    with pytest.MonkeyPatch.context() as patch:
        for kind in (hyperframe.frame.HeadersFrame, hyperframe.frame.DataFrame):
            patch.setattr(kind, "parse_body", refuse)
        events = mine.receive_data(answer)
    events = [e for e in events if getattr(e, "stream_id", None) == 1]
    assert [type(e) for e in events] == [
        h2.events.ResponseReceived,
        h2.events.DataReceived,
        h2.events.TrailersReceived,
        h2.events.StreamEnded,
    ]
