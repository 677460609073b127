"""A response stream's receive path: messages cut and packed any way across DATA
frames, flow-control credit never ahead of what the reader took, and the DATA
frames the connection reads itself judged as ``h2`` judges them.
"""

from __future__ import annotations

import itertools
import struct
from typing import Any

import anyio
import grpc
import h2.events
import pytest

from nadisc.grpc import Channel, RpcError
from nadisc.grpc._channel import _fixed_block
from nadisc.grpc._wire import Deframer, encode_message
from tests.support_checkpoints import count_yields

from .support import Conn, h2_server
from .test_fast_paths import HEADERS, _outcome, _pair

METHOD = "/reading.Service/Stream"
PING = "/reading.Service/Ping"

#: Payloads of several sizes, empty ones too; all of them fit one DATA frame.
PAYLOADS = [b"", b"a", b"b" * 100, b"c" * 3000, b"", b"d" * 7, b"e" * 12000, b"f" * 11]
WIRE = b"".join(encode_message(p, False) for p in PAYLOADS)


def _cuts(layout: str) -> list[int]:
    """Frame boundaries (offsets into WIRE) for one layout."""
    if layout == "one frame":  # several messages per DATA frame, none cut
        return []
    if layout == "7-byte frames":  # every message straddles frames, prefixes too
        return list(range(7, len(WIRE), 7))
    if layout == "message and a half":  # whole messages, then part of the next
        # mid-payload, mid-prefix, mid-payload, just past a prefix
        return [1616, 3128, 9000, 15150]
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", ["one frame", "7-byte frames", "message and a half"])
async def test_messages_cut_and_packed_any_way_across_data_frames(layout: str) -> None:
    """Each DATA frame goes out in its own write, so reads see the cuts too."""

    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id or 0
            await conn.respond(sid)
            bounds = [0, *_cuts(layout), len(WIRE)]
            for start, end in itertools.pairwise(bounds):
                await conn.data(sid, WIRE[start:end])
            await conn.trailers(sid)

    async with h2_server(scenario) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_stream(METHOD)(b"go", timeout=10)
        with anyio.fail_after(10):
            got = [m async for m in call]
            assert await call.code() == grpc.StatusCode.OK
        assert got == PAYLOADS


async def test_credit_never_runs_ahead_of_the_reader() -> None:
    """A 64 KiB window, 8 KB messages, a reader that takes six and stops.

    What the server is allowed to send past the window is exactly what the
    reader took (never the messages still queued in the client); once it
    reads on, the rest comes and the call ends OK.
    """
    size = 8000 + 5
    total = 20
    taken_first = 6

    conns: list[Conn] = []

    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        state = conn.state
        if isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id or 0
            if "sid" in state:  # the second call: a unary answer
                await conn.respond(sid)
                await conn.data(sid, encode_message(b"pong", False))
                await conn.trailers(sid)
                return
            state.update(sid=sid, sent=0, credit={0: 0, sid: 0})
            conns.append(conn)
            await conn.respond(sid)
        elif isinstance(event, h2.events.WindowUpdated) and "sid" in state:
            credit = state["credit"]
            if (event.stream_id or 0) in credit:
                credit[event.stream_id or 0] += event.delta or 0
        else:
            return
        sid = state["sid"]
        while state["sent"] < total and conn.h2.local_flow_control_window(sid) >= size:
            conn.h2.send_data(sid, encode_message(b"m" * 8000, False))
            state["sent"] += 1
        if state["sent"] == total and not state.get("ended"):
            state["ended"] = True
            await conn.trailers(sid)
        await conn.flush()

    async with (
        h2_server(scenario) as server,
        Channel(
            f"127.0.0.1:{server.port}", stream_window=65535, connection_window=65535
        ) as channel,
    ):
        call = channel.unary_stream(METHOD)(b"go", timeout=10)
        with anyio.fail_after(10):
            for _ in range(taken_first):
                assert await call.read() == b"m" * 8000
            # The server reads the client's frames in order: once it answered a
            # second call, it has every credit the first one gave.
            assert await channel.unary_unary(PING)(b"ping", timeout=5) == b"pong"
        (conn,) = conns
        state = conn.state
        taken = taken_first * size
        for stream_id in (0, state["sid"]):
            assert 0 < state["credit"][stream_id] <= taken
        assert state["sent"] * size <= 65535 + taken
        with anyio.fail_after(10):
            rest = [m async for m in call]
        assert len(rest) == total - taken_first
        assert await call.code() == grpc.StatusCode.OK


def test_whole_messages_are_read_from_the_chunk_and_a_cut_one_is_held() -> None:
    deframer = Deframer(limit=1000)
    three = b"".join(encode_message(p, False) for p in (b"one", b"", b"three"))
    assert deframer.feed(three) == 0  # credit for whole messages comes when taken
    assert [(flag, payload) for flag, payload, _ in deframer.messages] == [
        (False, b"one"),
        (False, b""),
        (False, b"three"),
    ]
    assert [owed for _, _, owed in deframer.messages] == [8, 5, 10]
    assert not deframer.partial
    deframer.messages.clear()
    cut = encode_message(b"x" * 10, True)
    # A whole message and 7 bytes of the next: those 7 are credited at once.
    assert deframer.feed(encode_message(b"y", False) + cut[:7]) == 7
    assert deframer.partial
    # The message is whole now: the rest of its bytes are owed when it is taken.
    assert deframer.feed(cut[7:]) == 0
    assert [(flag, payload, owed) for flag, payload, owed in deframer.messages] == [
        (False, b"y", 6),
        (True, b"x" * 10, 8),
    ]
    assert not deframer.partial


def test_a_bad_prefix_after_whole_messages_is_still_refused() -> None:
    deframer = Deframer(limit=10)
    with pytest.raises(RpcError) as caught:
        deframer.feed(encode_message(b"ok", False) + struct.pack(">BI", 0, 11))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("over", [False, True])
def test_data_on_a_stream_with_content_length_goes_through_h2(over: bool) -> None:
    """The connection reads DATA frames itself only where h2 has no length to check:
    a declared content-length is checked by h2 (same events, same error)."""
    mine, plain, server = _pair()
    block = _fixed_block(HEADERS)
    for client in (mine, plain):
        client.send_header_block(1, block, authority=b"127.0.0.1:1", end_stream=True)
    server.receive_data(mine.data_to_send())
    plain.data_to_send()
    server.send_headers(
        1,
        [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"content-length", b"9")],
    )
    body = encode_message(b"abcd" + (b"e" if over else b""), False)
    server.send_data(1, body)
    wire: Any = server.data_to_send()
    first, second = _outcome(mine, wire), _outcome(plain, wire)
    assert first == second
    if over:
        assert first[0] == "error"
    else:
        assert first[0] == "events"
        assert [name for name, _ in first[1]][-2:] == ["ResponseReceived", "DataReceived"]


@pytest.mark.parametrize("end_stream", [False, True])
def test_data_before_the_response_headers_is_refused_as_h2_refuses_it(end_stream: bool) -> None:
    """A DATA frame on an open stream that has had no HEADERS yet: the
    connection's own reading of DATA gives h2's protocol error, not a message."""
    mine, plain, _server = _pair()
    block = _fixed_block(HEADERS)
    for client in (mine, plain):
        client.send_header_block(1, block, authority=b"127.0.0.1:1", end_stream=False)
        client.data_to_send()
    body = encode_message(b"early", False)
    wire = struct.pack(">BHBBL", 0, len(body), 0, 1 if end_stream else 0, 1) + body
    first, second = _outcome(mine, wire), _outcome(plain, wire)
    assert first == second
    assert first[0] == "error"


async def test_has_response_tells_whether_read_returns_without_a_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three messages in one DATA frame: none is there before the call
    starts; once they arrived, each read returns one without giving the
    loop a turn, and ``has_response()`` holds until the last one is taken."""

    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id or 0
            await conn.respond(sid)
            await conn.data(sid, b"".join(encode_message(p, False) for p in (b"1", b"2", b"3")))
            await conn.trailers(sid)

    async with h2_server(scenario) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_stream(METHOD)(b"go", timeout=10)
        assert not call.has_response()  # not started
        with anyio.fail_after(10):
            await call.wait_for_connection()
            for _ in range(1000):  # the headers may come before the messages
                if call.has_response():
                    break
                await anyio.sleep(0.01)
        with monkeypatch.context() as patch:
            taken = count_yields(patch, {anyio.get_current_task().id})
            assert await call.read() == b"1"
            assert taken == []
        assert call.has_response()
        with monkeypatch.context() as patch:
            taken = count_yields(patch, {anyio.get_current_task().id})
            assert await call.read() == b"2"
            assert call.has_response()
            assert await call.read() == b"3"
            assert taken == []
        assert not call.has_response()
        with anyio.fail_after(10):
            assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
