"""Receive coalescing: in the middle of a response stream the reader waits a few
tens of microseconds on a ``timerfd`` before its next read, so a fast stream
comes several messages per read.

What is pinned here is the rule, not a timing: which reads wait (a dense
stream's third read onwards once the caller is done writing; never a unary
answer, a sparse stream, a ping-pong, a stream that ended, or with the
option off, without a timer or on one CPU), that nothing is lost or
reordered across a wait,
that the end of the connection during one is seen, and that the timer's
descriptor is closed with the connection. The effect on throughput and CPU
is measured by ``benchmarks/grpc_throughput.py``.
"""

from __future__ import annotations

import math
import os
import select
import sys
from typing import Any

import anyio
import grpc
import grpc.aio
import h2.events
import pytest

from nadisc.grpc import Channel, RpcError
from nadisc.grpc import _connection as connection_module
from nadisc.grpc._timer import ReadTimer, one_cpu, read_timer

from .support import Conn, frame, grpc_tasks, h2_server

STREAM = "/coalescing.Service/Stream"
UNARY = "/coalescing.Service/Unary"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")


def _readable(timer: ReadTimer, timeout_ms: int) -> bool:
    poller = select.poll()
    poller.register(timer.fd, select.POLLIN)
    return bool(poller.poll(timeout_ms))


# -- the timer ---------------------------------------------------------------------


@linux_only
def test_a_timer_is_readable_once_per_arming() -> None:
    timer = read_timer()
    assert timer is not None
    try:
        assert not _readable(timer, 0)
        timer.arm(50e-6)
        assert _readable(timer, 5000)
        timer.clear()
        assert not _readable(timer, 0)
        timer.clear()  # nothing to take: no error
        timer.arm(1e-12)  # rounds up to 1 ns, never to 0 (which would disarm it)
        assert _readable(timer, 5000)
        timer.arm(60.0)  # arming again takes the expiry not yet read
        assert not _readable(timer, 0)
    finally:
        timer.close()
    assert timer.fd == -1
    timer.close()  # twice is safe


def test_one_cpu_is_read_from_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert one_cpu()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3}, raising=False)
    assert not one_cpu()

    def refused(pid: int) -> set[int]:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_getaffinity", refused, raising=False)
    assert not one_cpu()
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert not one_cpu()


# -- the option ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ("40us", TypeError, "receive_coalescing must be a number of seconds or None, not str"),
        (True, TypeError, "receive_coalescing must be a number of seconds or None, not bool"),
        (0, ValueError, "receive_coalescing must be finite seconds > 0, not 0"),
        (-1e-6, ValueError, "receive_coalescing must be finite seconds > 0"),
        (math.nan, ValueError, "receive_coalescing must be finite seconds > 0, not nan"),
        (math.inf, ValueError, "receive_coalescing must be finite seconds > 0, not inf"),
        (0.002, ValueError, "receive_coalescing must be at most 0.001 s"),
    ],
)
def test_bad_coalescing_is_refused_naming_the_option(
    value: object, error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as caught:
        Channel("127.0.0.1:1", receive_coalescing=value)  # type: ignore[arg-type]
    assert str(caught.value).startswith("Channel('127.0.0.1:1'): ")
    assert words in str(caught.value)


def test_coalescing_defaults_to_40_microseconds_and_may_be_off() -> None:
    assert Channel("127.0.0.1:1").receive_coalescing == 80e-6
    assert Channel("127.0.0.1:1", receive_coalescing=None).receive_coalescing is None
    assert Channel("127.0.0.1:1", receive_coalescing=1e-3).receive_coalescing == 1e-3


# -- the rule, on a scripted server ------------------------------------------------------


@pytest.fixture(autouse=True)
def _dense_on_two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule's tests hold on a machine of any size and speed: one CPU would
    turn waits off, and the reader's clock stands still, so every read of a
    stream after its second is as dense as can be (a test for sparse streams
    moves it on)."""
    monkeypatch.setattr(connection_module, "one_cpu", lambda: False)
    monkeypatch.setattr(connection_module, "_clock", lambda: 0.0)


class Script:
    """A server that answers the stream method with ``count`` messages in
    lockstep with the caller (message k+1 is written once the caller took
    message k, so each comes in a read of its own), then waits for
    :attr:`go_on` before the trailers (or, with ``drop``, closes the
    connection instead); the unary method gets one message."""

    def __init__(self, count: int, *, drop: bool = False) -> None:
        self.count = count
        self.drop = drop
        self.go_on = anyio.Event()
        self._taken = 0
        self._more = anyio.Event()
        #: The connection's waits so far each time the caller got a message.
        self.waits_seen: list[int] = []

    def took(self, channel: Channel) -> None:
        self.waits_seen.append(_connection(channel).coalesced)
        self._taken += 1
        self._more.set()
        self._more = anyio.Event()
        if len(self.waits_seen) == self.count:
            self.go_on.set()

    async def __call__(self, conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            conn.state[str(event.stream_id)] = dict(event.headers or ())[b":path"]
        if not isinstance(event, h2.events.StreamEnded):
            return
        sid = event.stream_id or 0
        await conn.respond(sid)
        if conn.state[str(sid)] == UNARY.encode():
            await conn.data(sid, frame(b"one"))
            await conn.trailers(sid)
            return
        for number in range(self.count):
            while self._taken < number:
                await self._more.wait()
            await conn.data(sid, frame(b"message %d" % number))
        await self.go_on.wait()
        if self.drop:
            await conn.stream.aclose()
            return
        await conn.trailers(sid)


def _connection(channel: Channel) -> Any:
    conn = channel._conn
    assert conn is not None
    return conn


async def _read_stream(channel: Channel, script: Script) -> list[bytes]:
    """Every message of one stream call, in order, asserting its OK end."""
    call = channel.unary_stream(STREAM)(b"go", timeout=30)
    got: list[bytes] = []
    with anyio.fail_after(30):
        async for message in call:
            got.append(message)
            script.took(channel)
        assert await call.code() == grpc.StatusCode.OK
    assert got == [b"message %d" % n for n in range(script.count)]
    return got


@linux_only
async def test_every_read_of_a_dense_stream_after_its_second_waits_and_loses_nothing() -> None:
    """Each message in a read of its own: the reads of messages 0 (the stream's
    first DATA) and 1 (the first read of the burst: nothing before it to
    judge how dense it is) go straight on; every later one waits, decided
    before the caller sees its message. All come in order, and the end too."""
    script = Script(12)
    async with h2_server(script) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        await _read_stream(channel, script)
        assert script.waits_seen == [0, 0, *range(1, script.count - 1)]
        conn = _connection(channel)
        timer = conn._timer
        assert timer is not None and timer.fd >= 0
    assert timer.fd == -1  # closed with the connection
    assert conn._timer is None


@linux_only
async def test_a_sparse_stream_never_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads further apart than 8 times the wait (a watch's events): a wait
    would find nothing and cost a wakeup, so none is made."""
    ticks = iter(range(0, 10**6, 1))
    monkeypatch.setattr(connection_module, "_clock", lambda: next(ticks) * 641e-6)
    script = Script(12)
    async with h2_server(script) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        await _read_stream(channel, script)
        assert script.waits_seen == [0] * script.count
        assert _connection(channel)._timer is None
    # Closer than 8 times the wait, the same stream waits from its third read on.
    ticks = iter(range(0, 10**6, 1))
    monkeypatch.setattr(connection_module, "_clock", lambda: next(ticks) * 639e-6)
    script = Script(12)
    async with h2_server(script) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        await _read_stream(channel, script)
        assert script.waits_seen == [0, 0, *range(1, script.count - 1)]


@linux_only
async def test_a_ping_pong_never_waits_until_the_caller_is_done_writing() -> None:
    """A bidirectional stream whose server answers each request with one message:
    while the caller still writes, the next message may be the reply to its
    next request, so no read waits (a wait would delay every turn). Once the
    caller is done writing, the server's remaining messages are a burst like
    any other and the reads from the second on wait."""
    pings = 8
    tail = 6

    async def scenario(conn: Conn, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            await conn.respond(event.stream_id or 0)
        elif isinstance(event, h2.events.DataReceived) and event.data:
            sid = event.stream_id or 0
            await conn.data(sid, frame(b"pong " + event.data[5:]))
        elif isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id or 0
            for number in range(tail + 1):
                while len(waits) < pings + number:  # lockstep with the caller
                    await took.wait()
                if number < tail:
                    await conn.data(sid, frame(b"tail %d" % number))
            await conn.trailers(sid)

    waits: list[int] = []
    took = anyio.Event()
    async with h2_server(scenario) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_stream(STREAM)(timeout=30)
        with anyio.fail_after(30):
            for number in range(pings):
                await call.write(b"%d" % number)
                assert await call.read() == b"pong %d" % number
                waits.append(_connection(channel).coalesced)
            await call.done_writing()
            for number in range(tail):
                assert await call.read() == b"tail %d" % number
                waits.append(_connection(channel).coalesced)
                took.set()
                took = anyio.Event()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
    assert waits[:pings] == [0] * pings
    assert waits[pings:] == [0, *range(1, tail)]


async def test_unary_answers_never_wait() -> None:
    """One message per answer: no read of a unary call arms the timer."""
    script = Script(0)
    async with h2_server(script) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        unary = channel.unary_unary(UNARY)
        with anyio.fail_after(30):
            for _ in range(20):
                assert await unary(b"x", timeout=30) == b"one"
        assert _connection(channel).coalesced == 0
        assert _connection(channel)._timer is None


@pytest.mark.parametrize("why", ["option off", "no timerfd", "one CPU"])
async def test_no_read_waits_and_the_stream_reads_as_before(
    why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The option off; a platform without ``timerfd`` (or a kernel out of
    descriptors: the reader asks once, then reads on); a process on one CPU
    (where the timer would take the CPU back from a sender on the same host,
    measured slower in docs/grpc.md: the option stays set, unused)."""
    asked: list[None] = []

    def no_timer() -> None:
        asked.append(None)

    options: dict[str, Any] = {}
    if why == "option off":
        options["receive_coalescing"] = None
    elif why == "no timerfd":
        monkeypatch.setattr(connection_module, "read_timer", no_timer)
    else:
        monkeypatch.setattr(connection_module, "one_cpu", lambda: True)
    script = Script(12)
    async with (
        h2_server(script) as server,
        Channel(f"127.0.0.1:{server.port}", **options) as channel,
    ):
        await _read_stream(channel, script)
        assert script.waits_seen == [0] * script.count
        assert _connection(channel)._timer is None
        if why == "one CPU":
            assert channel.receive_coalescing == 80e-6
    assert len(asked) == (1 if why == "no timerfd" else 0)


@linux_only
async def test_a_timer_the_kernel_stops_arming_is_closed_and_reads_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first wait is armed, the second is refused (``timerfd_settime``
    failing): the timer is closed (on asyncio its reader is removed from the
    loop first), no further wait is tried, and the stream reads on to its end."""
    made: list[ReadTimer] = []

    def failing_second_time() -> ReadTimer | None:
        timer = read_timer()
        assert timer is not None
        real_arm = timer._arm
        arms: list[int] = []

        def arm(fd: int, ns: int) -> None:
            arms.append(ns)
            if len(arms) > 1:
                raise OSError(22, "Invalid argument")
            real_arm(fd, ns)

        timer._arm = arm
        made.append(timer)
        return timer

    monkeypatch.setattr(connection_module, "read_timer", failing_second_time)
    script = Script(12)
    async with h2_server(script) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        await _read_stream(channel, script)
        assert script.waits_seen == [0, 0, *[1] * (script.count - 2)]
        assert _connection(channel)._timer is None
        assert len(made) == 1 and made[0].fd == -1


@linux_only
async def test_the_connection_ending_during_the_waits_fails_the_call() -> None:
    """The server closes the connection in the middle of the stream (asyncio's
    transport may be paused for a wait then): the call ends UNAVAILABLE."""
    script = Script(10, drop=True)
    async with h2_server(script) as server, Channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_stream(STREAM)(b"go", timeout=30)
        got = []
        with anyio.fail_after(30):
            with pytest.raises(RpcError) as caught:
                async for message in call:
                    got.append(message)
                    script.took(channel)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(got) == script.count
        assert script.waits_seen[-1] == script.count - 2


@linux_only
async def test_closing_in_the_middle_of_a_burst_leaves_no_task_and_no_descriptor() -> None:
    """The longest wait allowed, the call cancelled and the channel closed right
    after a wait was armed: no task of the channel is left and the timer's
    descriptor is closed."""
    script = Script(10)
    timer: ReadTimer | None = None
    async with h2_server(script) as server:
        async with Channel(f"127.0.0.1:{server.port}", receive_coalescing=1e-3) as channel:
            call = channel.unary_stream(STREAM)(b"go", timeout=30)
            with anyio.fail_after(30):
                for number in range(3):
                    assert await call.read() == b"message %d" % number
                    script.took(channel)
            assert script.waits_seen == [0, 0, 1]
            timer = _connection(channel)._timer
            assert timer is not None
            call.cancel()
        script.go_on.set()
    assert timer.fd == -1
    assert grpc_tasks() == 0
