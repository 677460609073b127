"""One HTTP/2 connection to a gRPC server: the ``h2`` state machine on an anyio byte stream.

Contract: a :class:`Connection` is run by its channel's task group
(:meth:`Connection.run`: a reader, a writer and, when asked, a keepalive
task; nothing else). Callers open :class:`Stream` objects on it from their
own tasks, and every wire action a caller takes is a synchronous change to
the ``h2`` state followed by :meth:`Connection.flush`, which sends the frames
from the caller's task when the socket takes them at once (no task switch)
and leaves the rest to the writer. So a cancelled caller never leaves half a
frame on the wire, and releasing a stream (RST_STREAM(CANCEL) when it is
still open) needs no ``await``.

Flow control: each stream advertises ``stream_window`` bytes and the
connection ``connection_window``. Credit goes back as the caller takes
messages (see :class:`nadisc.grpc._wire.Deframer`), so what a slow reader
holds is bounded by the window plus one message in progress (itself bounded
by the receive limit). Outbound, a sender waits for the peer's window and
for the writer to drain what it queued past ``_HIGH_WATER``.

Receive coalescing: while a response stream comes densely (its second DATA
frame or later came in the read just taken, less than ``_DENSE`` times
``receive_coalescing`` after the previous such read) and that read emptied
the socket, the reader does not wait on the socket at once: it waits
``receive_coalescing`` seconds (tens of microseconds, on a ``timerfd``,
see :mod:`nadisc.grpc._timer`) and then reads whatever came meanwhile, so a
stream sent faster than it is read arrives several messages per read
instead of one read, and one wakeup, per message. A stream's first DATA
frame (so every unary answer) never waits, nor does a stream whose request
side is still open (its next message may be the reply to the caller's
next request: a ping-pong would pay the wait on every turn), a sparse
stream's message (a watch's events: the wait would find nothing and cost a
wakeup), a full read, or any read of a process that may run on one CPU
only. Only plaintext connections on trio's and asyncio's own sockets do
this (asyncio by pausing the transport while it waits); TLS and platforms
without a ``timerfd`` read as before.

Concurrency: a stream waits for a slot while the server's
``SETTINGS_MAX_CONCURRENT_STREAMS`` are all in use (a queue on this
connection; no second connection is opened for it).

Connect timeout: no stream opens before the server's first SETTINGS (so a
listener that never speaks HTTP/2 holds no request); with
``settings_deadline``, they must arrive by then, or the connection is lost
and the calls waiting on it fail with UNAVAILABLE, marked unprocessed.

After our own GOAWAY (:meth:`Connection.close`) frames from the server are
dropped unread by ``h2``, whose state is CLOSED: never answered with a
PROTOCOL_ERROR GOAWAY.

GOAWAY: no new streams here; streams at or below ``last_stream_id`` go on;
streams above it fail with ``unprocessed`` set, which tells the call it may
retry them on a new connection. ``h2`` closes its state machine on a received
GOAWAY (so the frames of the streams that may still finish would be refused);
:class:`_ClientH2` keeps it open, which RFC 9113 section 6.8 allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol, cast

import anyio
import anyio.abc
import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import h2.stream
import sniffio
from anyio._backends import _asyncio as anyio_asyncio
from anyio.abc import SocketAttribute
from h2.errors import ErrorCodes
from hyperframe.exceptions import InvalidDataError, InvalidFrameError
from hyperframe.frame import ContinuationFrame, Frame, HeadersFrame, RstStreamFrame

from ._errors import RpcError, code_from_reset
from ._timer import ReadTimer, one_cpu, read_timer
from ._wire import Deframer

__all__ = ["Connection", "Stream", "Unprocessed"]

#: Bytes queued for the writer past which a sender waits for it to drain.
_HIGH_WATER = 256 * 1024
_READ_SIZE = 256 * 1024
#: Credit for messages taken is given back in steps of this much while more
#: messages are queued (one WINDOW_UPDATE check per step, not per message).
_CREDIT_BATCH = 16 * 1024
_PING_DATA = b"nadiscKA"
#: Up to this many streams open, a flush sends from the calling task. With more,
#: the writer task sends for all of them at once: the calls a batch of responses
#: woke queue their frames in the same turn of the loop, and one send carries
#: them all (a send per call costs more than the one task switch).
_DIRECT_STREAMS = 2
#: A stream's reads closer together than this many times ``receive_coalescing``
#: are a burst worth waiting in (at 80 us: 640 us, over 1,500 reads a second).
_DENSE = 8
#: The reader's clock for telling a burst from a sparse stream (tests replace it).
_clock = time.monotonic


class _Event(Protocol):
    """One wait of one task (a stream's reader or sender): ``set`` ends it."""

    def set(self) -> None: ...
    def wait(self) -> Awaitable[Any]: ...


@functools.cache
def _trio_event() -> Callable[[], _Event]:
    """Trio: ``set`` reschedules the one waiting task itself (``trio.Event`` keeps a
    parking lot for any number of waiters, which a stream never has)."""
    from trio.lowlevel import Abort, Task, checkpoint, current_task, reschedule
    from trio.lowlevel import wait_task_rescheduled as wait_rescheduled

    class TrioWake:
        __slots__ = ("_set", "_task")

        def __init__(self) -> None:
            self._task: Task | None = None
            self._set = False

        def set(self) -> None:
            self._set = True
            task = self._task
            if task is not None:
                self._task = None
                reschedule(task)

        async def wait(self) -> None:
            if self._set:
                await checkpoint()
                return
            self._task = current_task()
            await wait_rescheduled(self._abort)

        def _abort(self, _: object) -> Abort:
            self._task = None  # cancelled: a later set() has no one to wake
            return Abort.SUCCEEDED

    return TrioWake


class _FutureWake:
    """Asyncio: a bare future (``asyncio.Event`` keeps a list of waiters and looks
    up the running loop on every wait)."""

    __slots__ = ("_future",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._future: asyncio.Future[None] = loop.create_future()

    def set(self) -> None:
        if not self._future.done():  # a cancelled wait cancelled the future
            self._future.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        return self._future


class Unprocessed(Exception):
    """The connection takes no new streams (GOAWAY or closed): open on another one."""


#: The stream states in which a response's HEADERS and DATA are read without ``h2``'s
#: frame machinery (a state that would refuse them goes through ``h2``).
_RECEIVING = frozenset({h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_LOCAL})
#: RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE: one frame each, parsed here
#: and handed to ``h2`` frame by frame.
_WHOLE_FRAMES = frozenset({3, 4, 6, 7, 8})
#: A frame header: length (high byte, low 16 bits), type, flags, stream id.
_FRAME_HEAD = struct.Struct(">BHBBL")


class _ClientH2(h2.connection.H2Connection):
    """``h2`` that lets streams below a received GOAWAY's last id finish, and that
    opens a stream from a header block its caller encoded (:meth:`send_header_block`).
    """

    _forget_at = 64
    #: The start of a frame whose end has not arrived (see receive_data).
    _held = b""

    def _receive_goaway_frame(self, frame: Any) -> Any:
        result = super()._receive_goaway_frame(frame)
        self.state_machine.state = h2.connection.ConnectionState.CLIENT_OPEN
        return result

    def receive_data(self, data: bytes) -> list[h2.events.Event]:  # type: ignore[override]
        """``h2``'s ``receive_data``, with the frames of a gRPC response read here.

        HEADERS (one frame, no padding or priority) and DATA (no padding) on a
        stream ``h2`` has open are parsed here and handed to the same ``h2``
        stream methods ``h2`` calls for them (state machine, flow-control
        windows, events), without building a ``hyperframe`` object per frame;
        a DATA frame that does not end its stream, on a stream with no
        content-length, gets what those methods would do to it (both windows
        shrink, a ``DataReceived``; its state stays as it is) without the
        state machine's call.
        RST_STREAM, SETTINGS, PING, GOAWAY and WINDOW_UPDATE are parsed by
        ``hyperframe`` and handled by ``h2`` frame by frame. Anything else (a
        header block in several frames, padding, priority, a stream ``h2``
        no longer has, unknown frame types, a partial frame), and everything
        after it in ``data``, goes through ``h2``'s ``receive_data`` itself
        (a frame cut by the end of ``data`` waits here for the rest),
        as does everything while ``h2`` holds a partial frame or an unfinished
        header block, or its connection is not open: the frames keep their
        order and ``h2`` stays the judge of every state and window.
        """
        if self._held:
            data = self._held + data
            self._held = b""
        buffer = self.incoming_buffer
        if (
            buffer._data
            or buffer._headers_buffer
            or self.state_machine.state is not h2.connection.ConnectionState.CLIENT_OPEN
        ):
            return super().receive_data(data)
        events: list[h2.events.Event] = []
        streams = self.streams
        window = self._inbound_flow_control_window_manager
        size = len(data)
        pos = 0
        partial = True  # the loop ends at a frame that has not all arrived yet
        try:
            while size - pos >= 9:
                high, low, kind, flags, sid = _FRAME_HEAD.unpack_from(data, pos)
                length = high << 16 | low
                end = pos + 9 + length
                if length > self.max_inbound_frame_size:
                    partial = False
                    break
                if end > size:
                    break
                partial = False
                if kind in _WHOLE_FRAMES:
                    try:
                        frame, _ = Frame.parse_frame_header(memoryview(data[pos : pos + 9]))
                        frame.parse_body(memoryview(data[pos + 9 : end]))
                    except (InvalidDataError, InvalidFrameError):
                        break  # h2 reads it again and says what is wrong
                    events += self._receive_frame(frame)
                    pos = end
                    partial = True
                    continue
                if kind > 1:
                    break
                sid &= 0x7FFFFFFF
                stream = streams.get(sid)
                if stream is None or stream.state_machine.state not in _RECEIVING:
                    break
                if kind == 0:  # DATA
                    if flags & 0x08:  # PADDED
                        break
                    window.window_consumed(length)
                    if (
                        not flags & 0x01
                        and stream._expected_content_length is None
                        and stream.state_machine.headers_received
                    ):
                        # What h2's stream does for DATA that does not end it,
                        # after the response headers (before them h2 refuses
                        # it): the state stays, the window shrinks
                        # (FlowControlError below 0), the length is counted,
                        # one event.
                        stream._inbound_window_manager.window_consumed(length)
                        stream._actual_content_length += length
                        events.append(
                            h2.events.DataReceived(
                                stream_id=sid,
                                data=data[pos + 9 : end],
                                flow_controlled_length=length,
                            )
                        )
                        pos = end
                        partial = True
                        continue
                    frames, more = stream.receive_data(
                        data[pos + 9 : end], bool(flags & 0x01), length
                    )
                else:  # HEADERS
                    if flags & 0x28 or not flags & 0x04:  # PADDED, PRIORITY; no END_HEADERS
                        break
                    headers = h2.connection._decode_headers(self.decoder, data[pos + 9 : end])
                    self.state_machine.process_input(h2.connection.ConnectionInputs.RECV_HEADERS)
                    frames, more = stream.receive_headers(
                        headers, bool(flags & 0x01), self.config.header_encoding
                    )
                if frames:
                    self._prepare_for_sending(frames)
                events += more
                pos = end
                partial = True
        except h2.exceptions.ProtocolError as e:
            self._terminate_connection(e.error_code)
            raise
        if pos < size:
            if partial:
                self._held = data[pos:]  # the rest comes with the next read
            else:
                events += super().receive_data(data[pos:] if pos else data)
        return events

    def _receive_frame(self, frame: Frame) -> list[h2.events.Event]:
        """``h2``'s own, less its trace line, which formats every frame (``repr``)
        whether or not anything logs it: 5-10 us of a unary call's four frames."""
        events: list[h2.events.Event]
        try:
            frames, events = self._frame_dispatch_table[frame.__class__](frame)
        except h2.exceptions.StreamClosedError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                f = RstStreamFrame(e.stream_id)
                f.error_code = e.error_code
                self._prepare_for_sending([f])
                events = e._events
            else:
                raise
        except h2.exceptions.StreamIDTooLowError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                f = RstStreamFrame(e.stream_id)
                f.error_code = ErrorCodes.STREAM_CLOSED
                self._prepare_for_sending([f])
                events = []
            elif self._stream_is_closed_by_end(e.stream_id):
                raise h2.exceptions.StreamClosedError(e.stream_id) from e
            else:
                raise
        else:
            self._prepare_for_sending(frames)
        return events

    def send_header_block(
        self, stream_id: int, block: bytes, *, authority: bytes, end_stream: bool
    ) -> None:
        """Open ``stream_id`` with a request's HPACK ``block``, as ``send_headers`` would.

        ``send_headers`` normalizes, checks and HPACK-encodes every header of
        every request; a channel's request headers are the same on every call
        but for the deadline and the metadata, so the channel encodes the fixed
        part once (with no dynamic-table entries, which keeps it valid on every
        connection) and the rest with :attr:`encoder`, then hands the block
        here. The caller keeps to the peer's stream limit itself (``h2``'s own
        check walks every stream); closed streams are dropped here now and
        then, as that check would.
        """
        self.state_machine.process_input(h2.connection.ConnectionInputs.SEND_HEADERS)
        stream = self._get_or_create_stream(stream_id, h2.connection.AllowedStreamIDs.ODD)
        stream.state_machine.process_input(h2.stream.StreamInputs.SEND_HEADERS)
        stream.request_method = b"POST"
        stream._authority = authority
        size = self.max_outbound_frame_size
        first = HeadersFrame(stream_id)
        first.data = block[:size]
        frames: list[Frame] = [first]
        for start in range(size, len(block), size):
            more = ContinuationFrame(stream_id)
            more.data = block[start : start + size]
            frames.append(more)
        frames[-1].flags.add("END_HEADERS")
        if end_stream:
            stream.state_machine.process_input(h2.stream.StreamInputs.SEND_END_STREAM)
            first.flags.add("END_STREAM")
        self._prepare_for_sending(frames)
        if len(self.streams) > self._forget_at:
            self._open_streams(stream_id % 2)  # drops closed streams
            self._forget_at = 2 * len(self.streams) + 64


def client_h2(*, stream_window: int, connection_window: int, max_header_list: int) -> _ClientH2:
    """The client side of one connection's HTTP/2 state, preface queued.

    Inbound headers are not checked or normalized by h2 (a walk over every
    header of every response): the channel reads only the few it knows by
    their lowercase names, so a malformed block is a typed error of its call
    (no grpc-status: UNKNOWN or INTERNAL), not of the connection.
    """
    config = h2.config.H2Configuration(
        client_side=True,
        header_encoding=None,
        validate_outbound_headers=False,
        validate_inbound_headers=False,
        normalize_inbound_headers=False,
        normalize_outbound_headers=False,
    )
    conn = _ClientH2(config=config)
    conn.local_settings = h2.settings.Settings(
        client=True,
        initial_values={
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: stream_window,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: max_header_list,
        },
    )
    conn.initiate_connection()
    if connection_window > 65535:
        conn.increment_flow_control_window(connection_window - 65535)
    return conn


def _direct_sender(byte_stream: anyio.abc.ByteStream) -> Callable[[bytes], int] | None:
    """A synchronous send of what the socket takes now (bytes taken), or ``None``.

    A caller that hands its frames to a writer task pays a task switch per
    flush; writing them from the caller's own task, without an ``await``,
    cannot leave half a frame behind when the caller is cancelled. That needs
    a send that never blocks: asyncio's transport (anyio's plain TCP stream
    writes to it too, and it buffers what the socket does not take) while it
    is not paused, or the non-blocking socket under trio. TLS streams (and
    anything else) return ``None``: their frames go through the writer task.
    """
    transport = getattr(byte_stream, "_transport", None)
    protocol: Any = getattr(byte_stream, "_protocol", None)
    if isinstance(transport, asyncio.WriteTransport) and hasattr(protocol, "write_event"):

        def transport_send(data: bytes) -> int:
            if not protocol.write_event.is_set():
                return 0  # paused: the writer task waits for the transport
            transport.write(data)
            return len(data)

        return transport_send
    raw = _trio_socket(byte_stream)
    if raw is not None:

        def socket_send(data: bytes) -> int:
            sent = 0
            try:
                sent = raw.send(data)  # almost always all of it at once
                if sent < len(data):
                    view = memoryview(data)
                    while sent < len(view):
                        sent += raw.send(view[sent:])
            except (BlockingIOError, InterruptedError):
                pass  # the socket is full: the writer task sends the rest
            return sent

        return socket_send
    return None


def _trio_socket(byte_stream: anyio.abc.ByteStream) -> socket.socket | None:
    """The non-blocking socket under anyio's plain trio TCP stream, else ``None``."""
    if type(byte_stream).__module__.endswith("._trio"):
        raw = byte_stream.extra(SocketAttribute.raw_socket, None)
        if isinstance(raw, socket.socket) and not raw.getblocking():
            return raw
    return None


class _FeedProtocol(anyio_asyncio.StreamProtocol):
    """anyio's asyncio stream protocol, but received bytes go to :attr:`conn`, when set,
    from the event loop's callback: no reader task wakes per read, and the
    transport is not paused and resumed around every read (two ``epoll_ctl``
    calls each time) as anyio's ``receive`` does.
    """

    conn: Connection | None = None
    transport: asyncio.Transport

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is None:
            super().data_received(data)
        elif not conn._received(bytes(data)):
            self.conn = None
        elif conn._burst is not None:
            conn.coalesce_asyncio(self.transport)


def _feed(byte_stream: anyio.abc.ByteStream, conn: Connection) -> _FeedProtocol | None:
    """Route the bytes of anyio's plain asyncio TCP stream to ``conn``; ``None`` elsewhere.

    The protocol object stays the one anyio's stream holds (its class becomes
    :class:`_FeedProtocol`), so sending, end of stream and errors work as
    before: ``receive`` then returns only at the end of the stream. Bytes
    anyio queued before this are fed first.
    """
    found: Any = getattr(byte_stream, "_protocol", None)
    transport = getattr(byte_stream, "_transport", None)
    if type(found) is not anyio_asyncio.StreamProtocol or not isinstance(
        transport, asyncio.Transport
    ):
        return None
    found.__class__ = _FeedProtocol
    protocol = cast(_FeedProtocol, found)
    protocol.transport = transport
    queued = protocol.read_queue
    while queued:
        if not conn._received(queued.popleft()):
            return protocol
    if not (protocol.is_at_eof or protocol.exception is not None):
        protocol.read_event.clear()
    protocol.conn = conn
    return protocol


class Stream:
    """The client side of one HTTP/2 stream; only its call uses it."""

    __slots__ = (
        "_more_read_wakes",
        "_owed",
        "_read_wake",
        "_send_wake",
        "closed",
        "conn",
        "deframer",
        "error",
        "headers",
        "id",
        "local_ended",
        "remote_ended",
        "seen_data",
        "trailers",
        "unprocessed",
    )

    def __init__(self, conn: Connection, stream_id: int, max_receive: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.deframer = Deframer(max_receive)
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.trailers: list[tuple[bytes, bytes]] | None = None
        self.remote_ended = False
        self.local_ended = False
        #: A terminal failure (reset, connection loss, a limit, a local abort).
        self.error: RpcError | None = None
        self.unprocessed = False
        self.closed = False
        #: A DATA frame of the response came (a later one continues a burst).
        self.seen_data = False
        #: Credit for messages taken and not yet given back (see _give_back).
        self._owed = 0
        # Made when the call waits (most calls never wait to send).
        self._read_wake: _Event | None = None
        #: Waits of further tasks reading at the same time (one task awaiting the
        #: headers while another reads the messages, as grpc.aio allows).
        self._more_read_wakes: list[_Event] | None = None
        self._send_wake: _Event | None = None

    # -- reader side (called by the connection) ------------------------------

    def wake(self) -> None:
        if self._read_wake is not None:
            self.wake_reader()
        if self._send_wake is not None:
            self._send_wake.set()

    def wake_reader(self) -> None:
        wake = self._read_wake
        if wake is not None:
            # Each wait is woken once; a woken reader makes a new one to wait again.
            self._read_wake = None
            wake.set()
            more = self._more_read_wakes
            if more is not None:
                self._more_read_wakes = None
                for wake in more:
                    wake.set()

    def _read_wait(self) -> _Event:
        """A new wait for the reader side: the first waiting task's, or one more."""
        wake = self.conn.new_event()
        if self._read_wake is None:
            self._read_wake = wake
        elif self._more_read_wakes is None:
            self._more_read_wakes = [wake]
        else:
            self._more_read_wakes.append(wake)
        return wake

    def wake_sender(self) -> None:
        if self._send_wake is not None:
            self._send_wake.set()

    def fail(self, error: RpcError, *, reset: bool) -> None:
        """End the stream with ``error``; with ``reset``, RST_STREAM(CANCEL) it on the wire."""
        if self.error is None:
            self.error = error
        if reset:
            self._reset(ErrorCodes.CANCEL)
        self.wake()

    # -- caller side ---------------------------------------------------------

    async def wait_headers(self) -> list[tuple[bytes, bytes]]:
        while self.headers is None:
            if self.error is not None:
                raise self.error
            if self.remote_ended:
                raise RpcError(
                    grpc.StatusCode.INTERNAL,
                    "the server ended the stream without response headers",
                    where=self.conn.name,
                )
            await self._read_wait().wait()
        return self.headers

    @property
    def has_message(self) -> bool:
        """Whether :meth:`take` would hand a message out now."""
        return bool(self.deframer.messages) and self.error is None

    def take(self) -> tuple[bool, bytes] | None:
        """A message already received, if there is one (synchronous; its credit goes back)."""
        messages = self.deframer.messages
        if not messages or self.error is not None:
            return None
        compressed, payload, owed = messages.popleft()
        self._give_back(owed, more=bool(messages))
        return compressed, payload

    def _give_back(self, owed: int, *, more: bool) -> None:
        """Credit for a message taken: gathered while more are queued, up to
        ``_CREDIT_BATCH``; all of it once the queue is empty (before any wait)."""
        owed += self._owed
        if owed and (not more or owed >= _CREDIT_BATCH):
            self._owed = 0
            self.conn.credit(self.id, owed)
        else:
            self._owed = owed

    async def next_message(self) -> tuple[bool, bytes] | None:
        """The next (compressed, payload), or ``None`` once the server ended the stream."""
        messages = self.deframer.messages
        while True:
            if messages:
                compressed, payload, owed = messages.popleft()
                self._give_back(owed, more=bool(messages))
                return compressed, payload
            if self.error is not None:
                raise self.error
            if self.remote_ended:
                if self.deframer.partial:
                    raise RpcError(
                        grpc.StatusCode.INTERNAL,
                        "the server ended the stream inside a message",
                        where=self.conn.name,
                    )
                return None
            await self._read_wait().wait()

    async def send(self, data: bytes, *, end: bool) -> None:
        """Send DATA within the peer's windows; returns early if the server already ended.

        The frames queued in one pass go out in one flush (before a wait, at
        the end, or past ``_HIGH_WATER``, where the sender also waits for
        the writer).
        """
        conn = self.conn
        h2c = conn.h2
        view = memoryview(data)
        while True:
            if self.error is not None:
                raise self.error
            if self.remote_ended or self.closed:
                return
            if not view:
                if end:
                    h2c.end_stream(self.id)
                    self.local_ended = True
                conn.flush()
                return
            window = min(h2c.local_flow_control_window(self.id), h2c.max_outbound_frame_size)
            if window <= 0:
                conn.flush()
                self._send_wake = wake = self.conn.new_event()
                await wake.wait()
                continue
            chunk = view[:window]
            view = view[window:]
            last = end and not view
            h2c.send_data(self.id, chunk.tobytes(), end_stream=last)
            conn.queued += len(chunk)
            if last:
                self.local_ended = True
                conn.flush()
                return
            if conn.queued > _HIGH_WATER:
                conn.flush()
                await conn.drained()

    def release(self) -> None:
        """Forget the stream (synchronous); RST_STREAM(CANCEL) it if it is still open."""
        if self.closed:
            return
        self.closed = True
        if not (self.remote_ended and self.local_ended):
            self._reset(ErrorCodes.NO_ERROR if self.remote_ended else ErrorCodes.CANCEL)
        owed = self._owed + sum(owed for _, _, owed in self.deframer.messages)
        self._owed = 0
        self.deframer.messages.clear()
        if owed:
            self.conn.credit(self.id, owed)
        self.conn.forget(self)
        self.wake()

    def _reset(self, code: ErrorCodes) -> None:
        conn = self.conn
        if conn.closed or (self.remote_ended and self.local_ended):
            return
        try:
            conn.h2.reset_stream(self.id, code)
        except h2.exceptions.H2Error:
            return
        self.remote_ended = self.local_ended = True
        conn.flush()


class Connection:
    """A client HTTP/2 connection; see the module docstring."""

    def __init__(
        self,
        byte_stream: anyio.abc.ByteStream,
        *,
        name: str,
        authority: bytes,
        max_receive: int,
        max_metadata_size: int,
        stream_window: int,
        connection_window: int,
        keepalive_time: float | None,
        keepalive_timeout: float,
        keepalive_without_calls: bool,
        receive_coalescing: float | None = None,
        settings_deadline: float = math.inf,
        settings_timeout: str = "the server's SETTINGS frame did not arrive in time",
    ) -> None:
        self.name = name
        self._byte_stream = byte_stream
        #: One wait of a stream's reader or sender, on the loop's own primitives
        #: (anyio's Event wraps the loop's event and finds the loop each time).
        self.new_event: Callable[[], _Event] = (
            _trio_event()
            if sniffio.current_async_library() == "trio"
            else functools.partial(_FutureWake, asyncio.get_running_loop())
        )
        self.h2 = client_h2(
            stream_window=stream_window,
            connection_window=connection_window,
            max_header_list=max_metadata_size * 2,
        )
        self._max_receive = max_receive
        self._max_metadata = max_metadata_size
        self._authority = authority
        self.streams: dict[int, Stream] = {}
        self.draining = False
        self.closed = False
        #: The GOAWAY said ENHANCE_YOUR_CALM / too_many_pings: the channel backs off.
        self.too_many_pings = False
        #: Bytes of DATA handed to ``h2`` or to the writer and not yet on the socket.
        self.queued = 0
        self._send_now = _direct_sender(byte_stream)
        #: Bytes the socket did not take at once; the writer task sends them.
        self._pending = b""
        self._writing = False
        #: The server changed SETTINGS_HEADER_TABLE_SIZE: the next block says so first.
        self._table_update_due = False
        self._flush_wanted = anyio.Event()
        self._drained = anyio.Event()
        self._slot_freed = anyio.Event()
        self._ping_acked = anyio.Event()
        self._scope = anyio.CancelScope()
        self._keepalive_time = keepalive_time
        self._keepalive_timeout = keepalive_timeout
        self._keepalive_without_calls = keepalive_without_calls
        #: Seconds the reader waits for the rest of a burst (None: never waits;
        #: nor on one CPU, where the wait's timer takes the CPU back from a
        #: sender on the same host: measured slower, see docs/grpc.md).
        #: Also None once no timer can be had (none on this platform, or the
        #: kernel refused one): the reader then never asks again.
        self._coalesce = None if receive_coalescing is None or one_cpu() else receive_coalescing
        #: The stream whose DATA in the read just taken continued its response.
        self._burst: Stream | None = None
        #: When the last such read was taken (``_clock``).
        self._burst_read_at = -math.inf
        self._timer: ReadTimer | None = None
        self._timer_watched = False
        #: Waits the reader made for the rest of a burst (for tests and diagnosis).
        self.coalesced = 0
        #: When the server's first SETTINGS must have arrived (the channel's
        #: connect_timeout), and what the calls are told when it did not.
        self._settings_deadline = settings_deadline
        self._settings_timeout = settings_timeout
        self._settings_seen = anyio.Event()
        #: Calls waiting for the server's first SETTINGS to open their stream.
        self._waiting = 0
        self._failure: RpcError | None = None
        self._closing = False
        self.done = anyio.Event()
        self._flush_wanted.set()  # the preface and SETTINGS, once the writer runs

    # -- used by streams -----------------------------------------------------

    @property
    def usable(self) -> bool:
        return not (self.closed or self.draining)

    @property
    def greeted(self) -> bool:
        """The server's first SETTINGS arrived (streams may open)."""
        return self._settings_seen.is_set()

    def flush(self) -> None:
        """Put what ``h2`` has queued on the wire (synchronous).

        From the calling task when the socket takes it at once (one send for
        all the frames a call queued); what it does not take, and everything
        on a connection without a direct send (TLS), goes to the writer task.
        Bytes already waiting for the writer go first, so the order holds.
        """
        send_now = self._send_now
        if (
            send_now is None
            or self._writing
            or self._pending
            or self.closed
            or len(self.streams) > _DIRECT_STREAMS
        ):
            self._flush_wanted.set()
            return
        data = self.h2.data_to_send()
        if not data:
            return
        try:
            sent = send_now(data)
        except (OSError, RuntimeError) as exc:
            self._lost(f"sending failed: {type(exc).__name__}")
            return
        if sent < len(data):
            self._pending = data[sent:]
            self.queued = len(self._pending)
            self._flush_wanted.set()
        else:
            self.queued = 0

    async def drained(self) -> None:
        if self.queued > 0 and not self.closed:
            self._drained = anyio.Event()
            await self._drained.wait()

    def credit(self, stream_id: int, amount: int) -> None:
        if self.closed:
            return
        self.h2.acknowledge_received_data(amount, stream_id)
        self.flush()

    def forget(self, stream: Stream) -> None:
        if self.streams.pop(stream.id, None) is not None:
            self._slot_freed.set()
            self._slot_freed = anyio.Event()
            if self.draining and not self.streams:
                self.close()

    @property
    def open_now(self) -> bool:
        """A stream may start at once: usable, the server's SETTINGS in, a slot free."""
        return (
            not (self.closed or self.draining)
            and self._settings_seen.is_set()
            and len(self.streams) < self.h2.remote_settings.max_concurrent_streams
        )

    async def wait_open(self) -> None:
        """Until :attr:`open_now` holds; :class:`Unprocessed` when the connection
        takes no new streams, an ``RpcError`` marked unprocessed when it was lost
        before the server's SETTINGS.

        As grpc-go and grpc-java do, no stream opens before the server's first
        SETTINGS (a hung or non-HTTP/2 listener then holds no request). Over
        ``SETTINGS_MAX_CONCURRENT_STREAMS`` a stream waits for a slot here.
        """
        while not self.open_now:
            if not self.usable:
                failure = self._failure
                if not self._settings_seen.is_set() and (self.closed or failure is not None):
                    # Lost before the server spoke HTTP/2: no request was sent.
                    error = RpcError(
                        grpc.StatusCode.UNAVAILABLE if failure is None else failure.code(),
                        "the connection closed before the server's SETTINGS arrived"
                        if failure is None
                        else failure.details() or "",
                        where=self.name,
                    )
                    error.unprocessed = True
                    raise error
                raise Unprocessed
            # SETTINGS, a freed slot and a failure all set ``_slot_freed``;
            # keepalive counts the calls waiting here as calls.
            self._waiting += 1
            try:
                await self._slot_freed.wait()
            finally:
                self._waiting -= 1

    def start_stream(
        self,
        fixed: bytes,
        metadata: list[tuple[bytes, bytes]],
        *,
        body: bytes | None = None,
    ) -> Stream:
        """A new stream with its request headers sent (synchronous; only while
        :attr:`open_now` holds, see :meth:`wait_open`).

        ``fixed`` is an HPACK block that uses no dynamic-table entry (the
        multicallable's fixed headers and the call's ``grpc-timeout``);
        ``metadata`` is encoded here, with this connection's encoder, right
        before the block is queued (blocks must reach the server in the order
        they were encoded). With ``body`` (a whole unary request) the request
        is sent too and the stream ended, in the same flush, when the
        windows take it at once; else :attr:`Stream.local_ended` stays false
        and the caller sends ``body`` with :meth:`Stream.send`.
        """
        h2c = self.h2
        stream_id = h2c.get_next_available_stream_id()
        stream = Stream(self, stream_id, self._max_receive)
        self.streams[stream_id] = stream
        block = fixed
        if self._table_update_due:
            self._table_update_due = False
            block = h2c.encoder.encode([]) + block
        if metadata:
            block += h2c.encoder.encode(metadata)
        h2c.send_header_block(stream_id, block, authority=self._authority, end_stream=False)
        if body is not None and len(body) <= min(
            h2c.local_flow_control_window(stream_id), h2c.max_outbound_frame_size
        ):
            h2c.send_data(stream_id, body, end_stream=True)
            stream.local_ended = True
        self.flush()
        return stream

    def close(self) -> None:
        """Send GOAWAY and stop (synchronous); open streams fail with UNAVAILABLE."""
        if self.closed:
            return
        self.draining = True
        with contextlib.suppress(h2.exceptions.H2Error):
            self.h2.close_connection()
        self._fail_all(
            RpcError(grpc.StatusCode.UNAVAILABLE, "the channel was closed", where=self.name)
        )
        # The GOAWAY goes out (here or by the writer), then the writer ends the run.
        self._closing = True
        self.flush()
        self._flush_wanted.set()

    # -- the tasks -----------------------------------------------------------

    async def run(self) -> None:
        """Read, write and keep alive until the connection ends; owned by the channel."""
        try:
            with self._scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._writer)
                    if self._keepalive_time is not None or self._settings_deadline < math.inf:
                        tg.start_soon(self._timers)
                    await self._reader()
                    tg.cancel_scope.cancel()
        finally:
            self.closed = True
            self.draining = True
            self._fail_all(
                self._failure
                or RpcError(grpc.StatusCode.UNAVAILABLE, "the connection closed", where=self.name)
            )
            self._drained.set()
            self._slot_freed.set()
            self.done.set()
            await anyio.aclose_forcefully(self._byte_stream)

    def _fail_all(self, error: RpcError) -> None:
        for stream in list(self.streams.values()):
            # A stream the server already ended has its whole answer (messages
            # and status) in hand: a connection lost after that changes nothing.
            if not stream.remote_ended:
                stream.fail(error, reset=False)
        self._slot_freed.set()

    def _lost(self, details: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        if self._failure is None:
            self._failure = RpcError(code, details, where=self.name)
        self._fail_all(self._failure)
        self.closed = True
        self._scope.cancel()

    async def _writer(self) -> None:
        send = self._byte_stream.send
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted = anyio.Event()
            data = self._pending + self.h2.data_to_send()
            self._pending = b""
            self.queued = 0
            if data:
                self._writing = True
                try:
                    await send(data)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                    self._lost(f"sending failed: {type(exc).__name__}")
                    return
                finally:
                    self._writing = False
            self._drained.set()
            if self._closing:
                self.closed = True
                self._scope.cancel()
                return

    async def _reader(self) -> None:
        raw = _trio_socket(self._byte_stream)
        if raw is not None:
            try:
                await self._read_trio(raw)
            finally:
                self._close_timer()
            return
        protocol = _feed(self._byte_stream, self)
        try:
            receive = self._byte_stream.receive
            while True:
                # With the feed installed, the loop hands the bytes to
                # _received itself and this returns only at the end.
                try:
                    data = await receive(_READ_SIZE)
                except anyio.EndOfStream:
                    self._lost("the server closed the connection")
                    return
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                    # anyio's BrokenResourceError wraps the OS's reason (a reset).
                    cause = exc.__cause__ if isinstance(exc, anyio.BrokenResourceError) else None
                    self._lost(f"the connection broke: {type(cause or exc).__name__}")
                    return
                if not self._received(data):
                    return
        finally:
            if protocol is not None:
                protocol.conn = None
                self._close_timer()
                protocol.transport.resume_reading()  # if a burst's wait paused it

    def _coalescing_timer(self) -> ReadTimer | None:
        """The timer, armed, when the reader should wait for the rest of a burst
        before its next read (see the module docstring); else ``None``."""
        burst = self._burst
        if burst is None:
            return None
        self._burst = None
        if (
            burst.remote_ended
            or not burst.local_ended  # a message may be a reply to the caller's next
            or burst.error is not None
            or self._coalesce is None
        ):
            return None
        now = _clock()
        since, self._burst_read_at = now - self._burst_read_at, now
        if since > _DENSE * self._coalesce:
            return None  # sparse: the wait would find nothing
        timer = self._timer
        if timer is None:
            timer = self._timer = read_timer()
            if timer is None:
                self._coalesce = None
                return None
        try:
            timer.arm(self._coalesce)
        except OSError:  # the kernel refused the timer: read on without waits
            self._close_timer()
            return None
        self.coalesced += 1
        return timer

    def coalesce_asyncio(self, transport: asyncio.Transport) -> None:
        """Asyncio: after a read, pause the transport for the rest of a burst."""
        timer = self._coalescing_timer()
        if timer is None:
            return
        if not self._timer_watched:
            self._timer_watched = True
            asyncio.get_running_loop().add_reader(timer.fd, self._timer_fired, transport)
        transport.pause_reading()

    def _timer_fired(self, transport: asyncio.Transport) -> None:
        timer = self._timer
        if timer is not None:
            timer.clear()
            transport.resume_reading()

    def _close_timer(self) -> None:
        """Close the timer (from the reader, so no task is waiting on it: trio
        forgets a descriptor once its wait ends, asyncio's reader is removed
        here); no other is made for this connection."""
        timer, self._timer = self._timer, None
        self._coalesce = None
        if timer is None:
            return
        if self._timer_watched:
            self._timer_watched = False
            asyncio.get_running_loop().remove_reader(timer.fd)
        timer.close()

    async def _read_trio(self, raw: socket.socket) -> None:
        """Trio: ``recv`` on the socket itself, waiting for it when it has nothing.

        The order of trio's own ``recv`` (under anyio's stream), less its
        layers and one ``recv`` per read: a read shorter than ``_READ_SIZE``
        took all the socket had, so the reader waits for the socket next (it
        does not try a ``recv`` that would find nothing); a full read is
        followed by one yield to the scheduler and the next ``recv``. Either
        way the callers it woke run before the next read (they send their next
        requests first, more answers come per read) and a flood cannot starve
        them.
        """
        import trio

        wait_readable = trio.lowlevel.wait_readable
        while True:
            try:
                data = raw.recv(_READ_SIZE)
            except (BlockingIOError, InterruptedError):
                data = None  # woken with nothing to read: wait again
            except (trio.ClosedResourceError, OSError) as exc:
                self._lost(f"the connection broke: {type(exc).__name__}")
                return
            if data is not None:
                if not data:
                    self._lost("the server closed the connection")
                    return
                if not self._received(data):
                    return
                if len(data) == _READ_SIZE:
                    await trio.lowlevel.checkpoint()
                    continue
                if self._burst is not None:
                    timer = self._coalescing_timer()
                    if timer is not None:
                        # No clear(): arming again resets the expiry, and
                        # only this task waits on the descriptor.
                        await wait_readable(timer.fd)
                        continue
            try:
                await wait_readable(raw)
            except trio.ClosedResourceError as exc:
                self._lost(f"the connection broke: {type(exc).__name__}")
                return

    def _received(self, data: bytes) -> bool:
        """Hand ``data`` from the socket to ``h2`` and the streams (synchronous);
        ``False`` once the connection is lost (a broken protocol)."""
        if self.closed:
            return False
        if self._closing:
            # After our own GOAWAY the h2 state is CLOSED and every stream has
            # failed: what the server still sends (its SETTINGS, replies to our
            # frames) is read and dropped, never answered with PROTOCOL_ERROR.
            return True
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self.flush()  # h2's GOAWAY, if the socket takes it
            self._lost(
                f"the server broke the HTTP/2 protocol ({type(exc).__name__})",
                grpc.StatusCode.INTERNAL,
            )
            return False
        self._dispatch(events)
        self.flush()
        return True

    def _dispatch(self, events: Iterable[h2.events.Event]) -> None:
        streams = self.streams
        self._burst = None
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                sid = event.stream_id
                stream = streams.get(sid)
                flow = event.flow_controlled_length or 0
                data = event.data or b""
                if stream is None or stream.error is not None:
                    if flow:
                        self.h2.acknowledge_received_data(flow, sid)
                    continue
                try:
                    credit = stream.deframer.feed(data) + (flow - len(data))
                except RpcError as exc:
                    credit = flow
                    stream.fail(exc, reset=True)
                if credit:
                    self.h2.acknowledge_received_data(credit, sid)
                stream.wake_reader()
                if stream.seen_data:
                    self._burst = stream
                else:
                    stream.seen_data = True
            elif isinstance(event, h2.events.ResponseReceived):
                stream = streams.get(event.stream_id or 0)
                if stream is not None and self._headers_fit(stream, event.headers):
                    stream.headers = list(event.headers or ())
                    if event.stream_ended is not None:
                        stream.trailers = stream.headers
                    stream.wake_reader()
            elif isinstance(event, h2.events.TrailersReceived):
                stream = streams.get(event.stream_id or 0)
                if stream is not None and self._headers_fit(stream, event.headers):
                    stream.trailers = list(event.headers or ())
            elif isinstance(event, h2.events.StreamEnded):
                stream = streams.get(event.stream_id or 0)
                if stream is not None:
                    stream.remote_ended = True
                    stream.wake()
            elif isinstance(event, h2.events.StreamReset):
                stream = streams.get(event.stream_id or 0)
                if stream is not None and stream.remote_ended and stream.trailers is not None:
                    # RST_STREAM(NO_ERROR) after the trailers: the response is
                    # complete and the server wants no more of the request.
                    stream.local_ended = True
                    stream.wake()
                elif stream is not None:
                    stream.remote_ended = stream.local_ended = True
                    code = event.error_code or 0
                    if code == ErrorCodes.REFUSED_STREAM:
                        stream.unprocessed = True
                    stream.fail(
                        RpcError(
                            code_from_reset(code),
                            f"the server reset the stream ({_code_name(code)})",
                            where=self.name,
                        ),
                        reset=False,
                    )
            elif isinstance(event, h2.events.WindowUpdated):
                if not event.stream_id:
                    for stream in streams.values():
                        stream.wake_sender()
                else:
                    stream = streams.get(event.stream_id)
                    if stream is not None:
                        stream.wake_sender()
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                self._settings_seen.set()
                if h2.settings.SettingCodes.HEADER_TABLE_SIZE in event.changed_settings:
                    self._table_update_due = True
                for stream in streams.values():
                    stream.wake_sender()
                self._slot_freed.set()
                self._slot_freed = anyio.Event()
            elif isinstance(event, h2.events.ConnectionTerminated):
                self._goaway(event)
            elif isinstance(event, h2.events.PingAckReceived):
                self._ping_acked.set()

    def _headers_fit(self, stream: Stream, headers: Any) -> bool:
        size = sum(len(k) + len(v) + 32 for k, v in headers or ())
        if size <= self._max_metadata:
            return True
        stream.fail(
            RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server's metadata is {size} bytes, over the {self._max_metadata}-byte limit",
                where=self.name,
            ),
            reset=True,
        )
        return False

    def _goaway(self, event: h2.events.ConnectionTerminated) -> None:
        self.draining = True
        code = event.error_code or 0
        if code == ErrorCodes.ENHANCE_YOUR_CALM and b"too_many_pings" in (
            event.additional_data or b""
        ):
            self.too_many_pings = True
        last = event.last_stream_id if event.last_stream_id is not None else math.inf
        for sid, stream in list(self.streams.items()):
            if sid > last:
                stream.unprocessed = True
                stream.remote_ended = stream.local_ended = True
                stream.fail(
                    RpcError(
                        grpc.StatusCode.UNAVAILABLE,
                        "the server sent GOAWAY before processing the stream",
                        where=self.name,
                    ),
                    reset=False,
                )
        self._slot_freed.set()
        if not self.streams:
            self.close()

    async def _timers(self) -> None:
        """The connect timeout's last part (the server's first SETTINGS) and keepalive.

        One task for both, so a connection runs at most three (reader, writer,
        this); it ends once SETTINGS arrived when keepalive is off.
        """
        interval = self._keepalive_time
        next_ping = math.inf if interval is None else anyio.current_time() + interval
        while True:
            if self._settings_overdue():
                return
            settings_due = math.inf if self._settings_seen.is_set() else self._settings_deadline
            if settings_due < next_ping:
                with anyio.move_on_at(settings_due):
                    await self._settings_seen.wait()
                continue  # SETTINGS arrived, or the check above fails the connection
            if interval is None:
                return
            await anyio.sleep_until(next_ping)
            if (
                self.streams or self._waiting or self._keepalive_without_calls
            ) and not await self._ping():
                return
            next_ping = anyio.current_time() + interval

    def _settings_overdue(self) -> bool:
        """The server's first SETTINGS did not arrive by the connect deadline: fail."""
        if self._settings_seen.is_set() or anyio.current_time() < self._settings_deadline:
            return False
        self._lost(self._settings_timeout)
        return True

    async def _ping(self) -> bool:
        """A keepalive PING; ``False`` (the connection lost) when no ACK came in time."""
        self._ping_acked = anyio.Event()
        self.h2.ping(_PING_DATA)
        self.flush()
        answer_due = anyio.current_time() + self._keepalive_timeout
        while True:
            due = answer_due
            if not self._settings_seen.is_set():
                due = min(due, self._settings_deadline)
            with anyio.move_on_at(due):
                await self._ping_acked.wait()
                return True
            if self._settings_overdue():
                return False
            if anyio.current_time() >= answer_due:
                self._lost(
                    f"the server did not answer a keepalive ping within {self._keepalive_timeout} s"
                )
                return False


def _code_name(code: int) -> str:
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"error code {code}"
