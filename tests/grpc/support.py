"""Test helpers: a loopback HTTP/2 server that misbehaves on purpose, and a task count.

:class:`H2Server` speaks HTTP/2 with ``h2``'s server side on an anyio
listener in the test's own loop. What it answers is a *scenario*: an async
function called with the connection's :class:`Conn` for every ``h2`` event,
which may send anything ``h2`` lets a server send (or nothing). The server
records what the client did (requests, DATA, resets, pings, connections),
so tests assert on the client's wire behaviour, not only its errors.
"""

from __future__ import annotations

import dataclasses
import inspect
import struct
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import h2.config
import h2.connection
import h2.events
import h2.exceptions

Scenario = Callable[["Conn", h2.events.Event], Awaitable[None]]


@dataclasses.dataclass
class Record:
    connections: int = 0
    requests: list[tuple[int, dict[bytes, bytes]]] = dataclasses.field(default_factory=list)
    data: dict[int, bytearray] = dataclasses.field(default_factory=dict)
    resets: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    pings: int = 0
    ended: set[int] = dataclasses.field(default_factory=set)


class Conn:
    """One server-side connection as a scenario sees it."""

    def __init__(self, stream: anyio.abc.ByteStream, record: Record, number: int) -> None:
        self.stream = stream
        self.record = record
        self.number = number  # 1 for the first connection the server accepted
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        self.state: dict[str, Any] = {}

    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            await self.stream.send(data)

    async def respond(
        self, stream_id: int, headers: list[tuple[bytes, bytes]] | None = None, *, end: bool = False
    ) -> None:
        self.h2.send_headers(
            stream_id,
            headers or [(b":status", b"200"), (b"content-type", b"application/grpc")],
            end_stream=end,
        )
        await self.flush()

    async def data(self, stream_id: int, data: bytes, *, end: bool = False) -> None:
        self.h2.send_data(stream_id, data, end_stream=end)
        await self.flush()

    async def trailers(self, stream_id: int, status: int = 0, message: bytes = b"") -> None:
        pairs = [(b"grpc-status", str(status).encode())]
        if message:
            pairs.append((b"grpc-message", message))
        self.h2.send_headers(stream_id, pairs, end_stream=True)
        await self.flush()


class H2Server:
    def __init__(self, scenario: Scenario, *, settings: dict[int, int] | None = None) -> None:
        self.scenario = scenario
        self.settings = settings or {}
        self.record = Record()
        self.port = 0

    async def _serve(self, stream: anyio.abc.ByteStream) -> None:
        self.record.connections += 1
        conn = Conn(stream, self.record, self.record.connections)
        async with stream:
            conn.h2.initiate_connection()
            if self.settings:
                conn.h2.update_settings(self.settings)
            try:
                await conn.flush()
                while True:
                    try:
                        data = await stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        return
                    try:
                        events = conn.h2.receive_data(data)
                    except h2.exceptions.ProtocolError:
                        await conn.flush()
                        return
                    for event in events:
                        self._note(event)
                        await self.scenario(conn, event)
                    await conn.flush()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return

    def _note(self, event: h2.events.Event) -> None:
        record = self.record
        if isinstance(event, h2.events.RequestReceived):
            record.requests.append((event.stream_id or 0, dict(event.headers or ())))
        elif isinstance(event, h2.events.DataReceived):
            record.data.setdefault(event.stream_id or 0, bytearray()).extend(event.data or b"")
        elif isinstance(event, h2.events.StreamReset):
            record.resets.append((event.stream_id or 0, event.error_code or 0))
        elif isinstance(event, h2.events.PingReceived):
            record.pings += 1
        elif isinstance(event, h2.events.StreamEnded):
            record.ended.add(event.stream_id or 0)


def frame(payload: bytes, flag: int = 0) -> bytes:
    """One gRPC message: the 5-byte prefix (``flag``: compressed) and ``payload``."""
    return struct.pack(">BI", flag, len(payload)) + payload


async def answer_ok(conn: Conn, event: h2.events.Event) -> None:
    """A scenario: every request that ended is answered with one message ``ok``."""
    if isinstance(event, h2.events.StreamEnded):
        sid = event.stream_id or 0
        await conn.respond(sid)
        await conn.data(sid, frame(b"ok"))
        await conn.trailers(sid)


@asynccontextmanager
async def h2_server(
    scenario: Scenario, *, settings: dict[int, int] | None = None
) -> AsyncIterator[H2Server]:
    server = H2Server(scenario, settings=settings)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    server.port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, server._serve)
        yield server
        tg.cancel_scope.cancel()


def grpc_tasks() -> int:
    """Tasks of this loop running a coroutine defined in nadisc/grpc (trio or asyncio)."""
    if "trio" in sys.modules and _on_trio():
        import trio

        count = 0
        root = trio.lowlevel.current_root_task()
        assert root is not None
        stack = [root]
        while stack:
            task = stack.pop()
            if _ours(task.coro):
                count += 1
            for nursery in task.child_nurseries:
                stack.extend(nursery.child_tasks)
        return count
    import asyncio

    return sum(1 for task in asyncio.all_tasks() if _ours(task.get_coro()))


def _on_trio() -> bool:
    import sniffio

    return sniffio.current_async_library() == "trio"


def _ours(coro: Any) -> bool:
    code = getattr(coro, "cr_code", None)
    if code is None and inspect.iscoroutine(coro):
        code = coro.cr_code
    return code is not None and "nadisc/grpc" in code.co_filename.replace("\\", "/")


class Hung:
    """What a listener that never speaks saw: connections accepted and ended."""

    def __init__(self) -> None:
        self.port = 0
        self.accepted = 0
        self.ended = 0
        self.received = bytearray()


@asynccontextmanager
async def hung_listener() -> AsyncIterator[Hung]:
    """Accepts TCP, reads what comes and never sends a byte (no SETTINGS, no TLS)."""
    hung = Hung()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    hung.port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def hold(stream: anyio.abc.SocketStream) -> None:
        hung.accepted += 1
        async with stream:
            try:
                while True:
                    hung.received += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
        hung.ended += 1

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, hold)
        yield hung
        tg.cancel_scope.cancel()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS = 0x0, 0x1


def frame_types(data: bytes | bytearray) -> list[int]:
    """The type of each whole HTTP/2 frame in ``data`` (9-byte headers)."""
    kinds = []
    while len(data) >= 9:
        length = int.from_bytes(data[:3], "big")
        kinds.append(data[3])
        data = data[9 + length :]
    return kinds
