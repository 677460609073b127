"""One HTTP/2 connection to a gRPC server: the ``h2`` state machine on an anyio byte stream.

Contract: a :class:`Connection` is run by its channel's task group
(:meth:`Connection.run`: a reader, a writer and, when asked, a keepalive
task; nothing else). Callers open :class:`Stream` objects on it from their
own tasks, and every wire action a caller takes is a synchronous change to
the ``h2`` state followed by :meth:`Connection.kick`, which wakes the writer.
So a cancelled caller never leaves half a frame on the wire, and releasing a
stream (RST_STREAM(CANCEL) when it is still open) needs no ``await``.

Flow control: each stream advertises ``stream_window`` bytes and the
connection ``connection_window``. Credit goes back as the caller takes
messages (see :class:`nadisc.grpc._wire.Deframer`), so what a slow reader
holds is bounded by the window plus one message in progress (itself bounded
by the receive limit). Outbound, a sender waits for the peer's window and
for the writer to drain what it queued past ``_HIGH_WATER``.

Concurrency: a stream waits for a slot while the server's
``SETTINGS_MAX_CONCURRENT_STREAMS`` are all in use (a queue on this
connection; no second connection is opened for it).

GOAWAY: no new streams here; streams at or below ``last_stream_id`` go on;
streams above it fail with ``unprocessed`` set, which tells the call it may
retry them on a new connection. ``h2`` closes its state machine on a received
GOAWAY (so the frames of the streams that may still finish would be refused);
:class:`_ClientH2` keeps it open, which RFC 9113 section 6.8 allows.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any

import anyio
import anyio.abc
import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes

from ._errors import RpcError, code_from_reset
from ._wire import Deframer

__all__ = ["Connection", "Stream", "Unprocessed"]

#: Bytes queued for the writer past which a sender waits for it to drain.
_HIGH_WATER = 256 * 1024
_READ_SIZE = 256 * 1024
_PING_DATA = b"nadiscKA"


class Unprocessed(Exception):
    """The connection takes no new streams (GOAWAY or closed): open on another one."""


class _ClientH2(h2.connection.H2Connection):
    """``h2`` that lets streams below a received GOAWAY's last id finish."""

    def _receive_goaway_frame(self, frame: Any) -> Any:
        result = super()._receive_goaway_frame(frame)
        self.state_machine.state = h2.connection.ConnectionState.CLIENT_OPEN
        return result


class Stream:
    """The client side of one HTTP/2 stream; only its call uses it."""

    __slots__ = (
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
        self._read_wake = anyio.Event()
        self._send_wake = anyio.Event()

    # -- reader side (called by the connection) ------------------------------

    def wake(self) -> None:
        self._read_wake.set()
        self._send_wake.set()

    def wake_sender(self) -> None:
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
            self._read_wake = anyio.Event()
            await self._read_wake.wait()
        return self.headers

    async def next_message(self) -> tuple[bool, bytes] | None:
        """The next (compressed, payload), or ``None`` once the server ended the stream."""
        messages = self.deframer.messages
        while True:
            if messages:
                compressed, payload, owed = messages.popleft()
                if owed:
                    self.conn.credit(self.id, owed)
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
            self._read_wake = anyio.Event()
            await self._read_wake.wait()

    async def send(self, data: bytes, *, end: bool) -> None:
        """Send DATA within the peer's windows; returns early if the server already ended."""
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
                    conn.kick()
                return
            window = min(h2c.local_flow_control_window(self.id), h2c.max_outbound_frame_size)
            if window <= 0:
                self._send_wake = anyio.Event()
                await self._send_wake.wait()
                continue
            chunk = view[:window]
            view = view[window:]
            last = end and not view
            h2c.send_data(self.id, chunk.tobytes(), end_stream=last)
            if last:
                self.local_ended = True
            conn.queued += len(chunk)
            conn.kick()
            if last:
                return
            if conn.queued > _HIGH_WATER:
                await conn.drained()

    def release(self) -> None:
        """Forget the stream (synchronous); RST_STREAM(CANCEL) it if it is still open."""
        if self.closed:
            return
        self.closed = True
        if not (self.remote_ended and self.local_ended):
            self._reset(ErrorCodes.NO_ERROR if self.remote_ended else ErrorCodes.CANCEL)
        owed = sum(owed for _, _, owed in self.deframer.messages)
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
        conn.kick()


class Connection:
    """A client HTTP/2 connection; see the module docstring."""

    def __init__(
        self,
        byte_stream: anyio.abc.ByteStream,
        *,
        name: str,
        max_receive: int,
        max_metadata_size: int,
        stream_window: int,
        connection_window: int,
        keepalive_time: float | None,
        keepalive_timeout: float,
        keepalive_without_calls: bool,
    ) -> None:
        self.name = name
        self._byte_stream = byte_stream
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self.h2 = _ClientH2(config=config)
        self.h2.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: stream_window,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: max_metadata_size * 2,
            },
        )
        self.h2.initiate_connection()
        if connection_window > 65535:
            self.h2.increment_flow_control_window(connection_window - 65535)
        self._max_receive = max_receive
        self._max_metadata = max_metadata_size
        self.streams: dict[int, Stream] = {}
        self.draining = False
        self.closed = False
        #: The GOAWAY said ENHANCE_YOUR_CALM / too_many_pings: the channel backs off.
        self.too_many_pings = False
        self.queued = 0
        self._flush_wanted = anyio.Event()
        self._drained = anyio.Event()
        self._slot_freed = anyio.Event()
        self._ping_acked = anyio.Event()
        self._scope = anyio.CancelScope()
        self._keepalive_time = keepalive_time
        self._keepalive_timeout = keepalive_timeout
        self._keepalive_without_calls = keepalive_without_calls
        self._failure: RpcError | None = None
        self._closing = False
        self.done = anyio.Event()
        self.kick()

    # -- used by streams -----------------------------------------------------

    @property
    def usable(self) -> bool:
        return not (self.closed or self.draining)

    def kick(self) -> None:
        self._flush_wanted.set()

    async def drained(self) -> None:
        if self.queued > 0 and not self.closed:
            self._drained = anyio.Event()
            await self._drained.wait()

    def credit(self, stream_id: int, amount: int) -> None:
        if self.closed:
            return
        self.h2.acknowledge_received_data(amount, stream_id)
        self.kick()

    def forget(self, stream: Stream) -> None:
        if self.streams.pop(stream.id, None) is not None:
            self._slot_freed.set()
            self._slot_freed = anyio.Event()
            if self.draining and not self.streams:
                self.close()

    async def open_stream(self, headers: list[tuple[bytes, bytes]], *, end: bool) -> Stream:
        """A new stream with ``headers`` sent; waits for a concurrency slot first."""
        while True:
            if not self.usable:
                raise Unprocessed
            if len(self.streams) < self.h2.remote_settings.max_concurrent_streams:
                break
            await self._slot_freed.wait()
        stream_id = self.h2.get_next_available_stream_id()
        stream = Stream(self, stream_id, self._max_receive)
        self.streams[stream_id] = stream
        self.h2.send_headers(stream_id, headers, end_stream=end)
        stream.local_ended = end
        self.kick()
        return stream

    def close(self) -> None:
        """Send GOAWAY and stop (synchronous); open streams fail with UNAVAILABLE."""
        if self.closed:
            return
        self.draining = True
        with contextlib.suppress(h2.exceptions.H2Error):
            self.h2.close_connection()
        self.kick()
        self._fail_all(
            RpcError(grpc.StatusCode.UNAVAILABLE, "the channel was closed", where=self.name)
        )
        # The writer sends the GOAWAY, then the run ends.
        self._closing = True

    # -- the tasks -----------------------------------------------------------

    async def run(self) -> None:
        """Read, write and keep alive until the connection ends; owned by the channel."""
        try:
            with self._scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._writer)
                    if self._keepalive_time is not None:
                        tg.start_soon(self._keepalive, self._keepalive_time)
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
            data = self.h2.data_to_send()
            self.queued = 0
            if data:
                try:
                    await send(data)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                    self._lost(f"sending failed: {type(exc).__name__}")
                    return
            self._drained.set()
            if self._closing:
                self.closed = True
                self._scope.cancel()
                return

    async def _reader(self) -> None:
        receive = self._byte_stream.receive
        while True:
            try:
                data = await receive(_READ_SIZE)
            except anyio.EndOfStream:
                self._lost("the server closed the connection")
                return
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                self._lost(f"the connection broke: {type(exc).__name__}")
                return
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError as exc:
                self.kick()
                self._lost(
                    f"the server broke the HTTP/2 protocol ({type(exc).__name__})",
                    grpc.StatusCode.INTERNAL,
                )
                return
            self._dispatch(events)
            self.kick()

    def _dispatch(self, events: Iterable[h2.events.Event]) -> None:
        streams = self.streams
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
                stream._read_wake.set()
            elif isinstance(event, h2.events.ResponseReceived):
                stream = streams.get(event.stream_id or 0)
                if stream is not None and self._headers_fit(stream, event.headers):
                    stream.headers = list(event.headers or ())
                    if event.stream_ended is not None:
                        stream.trailers = stream.headers
                    stream._read_wake.set()
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

    async def _keepalive(self, interval: float) -> None:
        while True:
            await anyio.sleep(interval)
            if not self.streams and not self._keepalive_without_calls:
                continue
            self._ping_acked = anyio.Event()
            self.h2.ping(_PING_DATA)
            self.kick()
            with anyio.move_on_after(self._keepalive_timeout):
                await self._ping_acked.wait()
                continue
            self._lost(
                f"the server did not answer a keepalive ping within {self._keepalive_timeout} s"
            )
            return


def _code_name(code: int) -> str:
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"error code {code}"
