"""gRPC calls per second and client CPU per call: nadisc.grpc next to grpclib and grpcio.aio.

One grpcio (C core) server in another process (``--serve`` of this module,
on the aio API) answers two methods with raw bytes (no protobuf on either
side, so the rows measure the channels, not message classes):

- ``/bench.Bench/Unary``: a 10-byte request, a 10-byte response;
- ``/bench.Bench/Stream``: a 10-byte request, 1,000 responses of 100 bytes.

Rows: unary at concurrency 1, 16 and 64 (that many tasks, each calling in
turn on one channel), and the 1,000-message server stream (rate in messages
per second). Clients, interleaved round by round in this one process:

``nadisc.grpc, trio`` and ``nadisc.grpc, asyncio``
    ``nadisc.grpc.Channel`` (one HTTP/2 connection), on each loop, with its
    defaults: receive coalescing on (80 us; ``--coalescing off`` or
    ``--coalescing SECONDS`` to compare).
``grpclib``
    ``grpclib.client.Channel`` with ``UnaryUnaryMethod`` /
    ``UnaryStreamMethod`` (asyncio; h2 underneath too).
``grpcio.aio``
    ``grpc.aio.insecure_channel`` multicallables (asyncio; the C core).

Each cell is the best round's wall-clock rate and, beside it, the client
process's CPU time per call (``time.process_time``; for the stream row, per
message), both timed over the row's calls alone. In a unary row each
client's round starts its loop, connects and makes one warm-up call before
the timing starts, and closes the channel after it ends. The stream row is
one client at a time too, but finer grained: every client keeps one
connection for the whole run, on a loop of its own in a thread of its own
(anyio's blocking portals; the others' loops sit idle meanwhile), and a
round is one untimed stream of each client, then one stream per client in
turn, ten times (one per 200 calls), the order reversed every other turn.
Streams last about 35 ms, so the machine's slow and fast stretches (on the
2-core VM these shift a client's rate by 2x from one second to the next)
fall on every client alike rather than on whichever client's block they
hit. The server's CPU is in another process
and in none of those. Ratios: ours over grpclib and over grpcio.aio for each loop, trio
over asyncio, and CPU per call over grpclib's, each taken within a round
(the clients of a round run back to back) and summed up as the median over
the rounds with the lowest and highest round beside it: on a shared machine
the best round of each client may come from different moments.

Then the server's side of each cell: the server process's CPU per call (or
message) while that client ran (``/proc``, in 10 ms ticks, so a round of a
few hundred milliseconds reads within a few percent), and its busy share of
one core (rate times that CPU). The server is Python code on the asyncio
API; where that share is near 1.0 the server, not the client, sets the rate,
and every client's throughput ratio there says more about how the server
fares next to it on a 2-core machine than about the client.

Last, ``h2`` alone: the client CPU per unary call (and per stream message)
that the channel's ``h2`` work costs by itself, in memory (:func:`h2_floor_us`),
the floor under the channel's own per-call cost.

``--sweep off,40e-6,80e-6`` measures receive coalescing alone instead, with
far less noise than rounds of whole rows: on each loop it opens one channel
per wait (each its own connection to the same server) and streams 1,000
messages on each in turn, one stream at a time, the order reversed every
other pair, so that the machine's slow and fast moments fall on every wait
alike. Per wait: the median stream's wall time, the median over pairs of
its throughput over the first wait's in the same pair (with the quartiles),
the client's CPU per message and the server's (summed over all its streams).

Run: ``python -m benchmarks.grpc_throughput [--smoke] [--calls N] [--rounds R]
[--coalescing off|SECONDS] [--sweep WAITS [--pairs N]]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from benchmarks._grpc_server import cpu_seconds, serving_process

UNARY = "/bench.Bench/Unary"
STREAM = "/bench.Bench/Stream"
REQUEST = b"0123456789"
STREAM_MESSAGES = 1000

CLIENTS = ("nadisc.grpc, trio", "nadisc.grpc, asyncio", "grpclib", "grpcio.aio")
#: ``--sweep``: stream pairs per loop (each pair streams once on every wait).
SWEEP_PAIRS = 40
#: Keywords for nadisc.grpc.Channel beyond its defaults (``--coalescing``).
_CHANNEL_OPTIONS: dict[str, Any] = {}


class Spent(NamedTuple):
    """One client's round of one row: calls (or messages), wall and CPU seconds."""

    calls: int
    wall: float
    cpu: float


@dataclass
class Swept:
    """One wait of a ``--sweep`` on one loop: every stream's wall and client CPU
    seconds (in pair order), and the server's CPU seconds over all of them."""

    wait: float | None
    streams: list[tuple[float, float]] = field(default_factory=list)
    server_cpu: float = 0.0

    def throughput_over(self, first: Swept) -> list[float]:
        """Per pair, this wait's stream rate over ``first``'s, sorted."""
        return sorted(
            theirs[0] / mine[0] for mine, theirs in zip(self.streams, first.streams, strict=True)
        )


@dataclass
class Result:
    calls: int
    rounds: int
    #: (row, client) -> best calls (or messages) per second
    rate: dict[tuple[str, str], float] = field(default_factory=dict)
    #: (row, client) -> client CPU microseconds per call (or message), of that best round
    cpu_us: dict[tuple[str, str], float] = field(default_factory=dict)
    rows: list[str] = field(default_factory=list)
    #: (row, client) -> every round's (rate, CPU us); the ratios are taken round by round
    per_round: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)
    #: h2's own CPU per unary call and per stream message, microseconds (see h2_floor_us)
    h2_floor_us: tuple[float, float] = (0.0, 0.0)
    #: (row, client) -> the server process's CPU microseconds per call (or message),
    #: every round (Linux ``/proc``, 10 ms ticks; NaN elsewhere)
    server_us: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    #: ``--sweep``: loop -> one entry per wait, in the order given
    sweep: dict[str, list[Swept]] = field(default_factory=dict)

    def ratios(self, row: str, top: str, bottom: str, *, cpu: bool = False) -> list[float]:
        """``top`` over ``bottom`` in each round (both ran in it, one after the other)."""
        index = 1 if cpu else 0
        return [
            a[index] / b[index]
            for a, b in zip(self.per_round[(row, top)], self.per_round[(row, bottom)], strict=True)
        ]


# -- the server (a subprocess) --------------------------------------------------


async def _serve() -> None:
    import grpc
    import grpc.aio

    response = b"y" * 10
    message = b"z" * 100

    async def unary(request: bytes, context: Any) -> bytes:
        return response

    async def stream(request: bytes, context: Any) -> Any:
        for _ in range(STREAM_MESSAGES):
            yield message

    handler = grpc.method_handlers_generic_handler(
        "bench.Bench",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        },
    )
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1000)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)


# -- the floor: h2's own work per call, alone ------------------------------------------


def h2_floor_us(calls: int) -> tuple[float, float]:
    """Client CPU microseconds per unary call spent in ``h2`` alone, and per stream message.

    The channel's own ``h2`` connection class and settings, with an in-memory
    ``h2`` server answering as grpcio does (headers, one message, trailers;
    for the stream, 1,000 messages of 100 bytes in DATA frames). Only the
    client side's calls are timed: opening the stream with the pre-encoded
    header block, the request DATA, ``data_to_send``, ``receive_data`` of the
    answer and the flow-control credit. No sockets, no event loop, no task.
    """
    import h2.config
    import h2.connection
    import h2.events

    from nadisc.grpc._channel import _fixed_block
    from nadisc.grpc._connection import _ClientH2, client_h2
    from nadisc.grpc._wire import DEFAULT_MAX_METADATA_SIZE

    def client() -> _ClientH2:
        return client_h2(
            stream_window=1024 * 1024,
            connection_window=8 * 1024 * 1024,
            max_header_list=2 * DEFAULT_MAX_METADATA_SIZE,
        )

    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    server.initiate_connection()
    ours = client()
    ours.receive_data(server.data_to_send())
    server.receive_data(ours.data_to_send())
    ours.receive_data(server.data_to_send())
    block = _fixed_block(
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", UNARY.encode()),
            (b":authority", b"127.0.0.1:1"),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc"),
        ]
    )
    request = b"\0\0\0\0\x0a" + REQUEST
    head = [(b":status", b"200"), (b"content-type", b"application/grpc")]

    def answer(sent: bytes, sid: int, messages: int, size: int) -> bytes:
        server.receive_data(sent)
        server.send_headers(sid, head)
        for _ in range(messages):
            server.send_data(sid, b"\0\0\0\0" + bytes((size,)) + b"y" * size)
        server.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
        return server.data_to_send()

    def one(messages: int, size: int) -> float:
        t0 = time.process_time()
        sid = ours.get_next_available_stream_id()
        ours.send_header_block(sid, block, authority=b"127.0.0.1:1", end_stream=False)
        ours.send_data(sid, request, end_stream=True)
        sent = ours.data_to_send()
        spent = time.process_time() - t0
        data = answer(sent, sid, messages, size)
        t0 = time.process_time()
        for event in ours.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                ours.acknowledge_received_data(event.flow_controlled_length or 0, sid)
        credit = ours.data_to_send()
        spent += time.process_time() - t0
        server.receive_data(credit)
        return spent

    unary = sum(one(1, 10) for _ in range(calls)) / calls * 1e6
    streams = _streams(calls)
    stream = sum(one(STREAM_MESSAGES, 100) for _ in range(streams)) / streams / STREAM_MESSAGES
    return unary, stream * 1e6


# -- clients ------------------------------------------------------------------------


class Raw(bytes):
    """A message type for grpclib's codec: the bytes as they are."""

    def SerializeToString(self) -> bytes:
        return bytes(self)

    @classmethod
    def FromString(cls, data: bytes) -> Raw:
        return cls(data)


async def _fan(concurrency: int, calls: int, one: Callable[[], Awaitable[Any]]) -> None:
    per_task = max(1, calls // concurrency)

    async def worker() -> None:
        for _ in range(per_task):
            await one()

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)


async def _ours(port: int, row: str, calls: int) -> Spent:
    from nadisc.grpc import Channel

    async with Channel(f"127.0.0.1:{port}", **_CHANNEL_OPTIONS) as channel:
        unary = channel.unary_unary(UNARY)
        await unary(REQUEST)  # connect outside the timing
        return await _run_row(row, calls, lambda: unary(REQUEST))


async def _grpclib(port: int, row: str, calls: int) -> Spent:
    from grpclib.client import Channel, UnaryUnaryMethod

    channel = Channel("127.0.0.1", port)
    try:
        unary = UnaryUnaryMethod(channel, UNARY, Raw, Raw)
        await unary(Raw(REQUEST))
        return await _run_row(row, calls, lambda: unary(Raw(REQUEST)))
    finally:
        channel.close()


async def _grpcio(port: int, row: str, calls: int) -> Spent:
    import grpc.aio

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary: Any = channel.unary_unary(UNARY)
        await unary(REQUEST)
        return await _run_row(row, calls, lambda: unary(REQUEST))


async def _run_row(row: str, calls: int, unary: Callable[[], Awaitable[Any]]) -> Spent:
    """Run one unary row on a connected channel: how many calls it made, and
    the wall and process CPU seconds they took. The timing starts here, so
    the event loop's start, the connection and the warm-up call before it,
    and the channel's close after it, are not in it."""
    cpu, wall = time.process_time(), time.perf_counter()
    await _fan(int(row.rsplit("c=", 1)[1]), calls, unary)
    return Spent(_row_calls(row, calls), time.perf_counter() - wall, time.process_time() - cpu)


# -- the stream row: every client's stream in turn -------------------------------------


@contextlib.asynccontextmanager
async def _stream_client(
    client: str, port: int, options: dict[str, Any] | None = None
) -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """A connected ``client`` for the stream row: yields a function that makes
    one 1,000-message stream and gives the number of messages it read.
    ``options`` replace ``_CHANNEL_OPTIONS`` for nadisc.grpc's channel."""
    if client.startswith("nadisc.grpc"):
        from nadisc.grpc import Channel

        chosen = _CHANNEL_OPTIONS if options is None else options
        async with Channel(f"127.0.0.1:{port}", **chosen) as channel:
            ours = channel.unary_stream(STREAM)

            async def one() -> int:
                return len([message async for message in ours(REQUEST)])

            yield one
    elif client == "grpclib":
        from grpclib.client import Channel as GrpclibChannel
        from grpclib.client import UnaryStreamMethod

        grpclib_channel = GrpclibChannel("127.0.0.1", port)
        theirs = UnaryStreamMethod(grpclib_channel, STREAM, Raw, Raw)

        async def one() -> int:
            async with theirs.open() as call:
                await call.send_message(Raw(REQUEST), end=True)
                return len([message async for message in call])

        try:
            yield one
        finally:
            grpclib_channel.close()
    else:
        import grpc.aio

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as grpcio_channel:
            reference: Any = grpcio_channel.unary_stream(STREAM)

            async def one() -> int:
                return len([message async for message in reference(REQUEST)])

            yield one


async def _timed(one: Callable[[], Awaitable[int]]) -> Spent:
    """One stream of a connected client: messages read, wall and process CPU seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    count = await one()
    return Spent(count, time.perf_counter() - wall, time.process_time() - cpu)


class _StreamRow:
    """The stream row's clients, each connected once on a loop of its own in a
    thread of its own (anyio's blocking portals), streaming in turn."""

    def __init__(self, port: int, stack: contextlib.ExitStack) -> None:
        self._clients: dict[str, tuple[BlockingPortal, Callable[[], Awaitable[int]]]] = {}
        for client in CLIENTS:
            backend = "trio" if client == "nadisc.grpc, trio" else "asyncio"
            portal = stack.enter_context(start_blocking_portal(backend))
            one = stack.enter_context(
                portal.wrap_async_context_manager(_stream_client(client, port))
            )
            portal.call(_timed, one)  # connect and warm up, untimed
            self._clients[client] = (portal, one)

    def turn(self, client: str) -> Spent:
        """One stream of ``client``, while every other client waits."""
        portal, one = self._clients[client]
        return portal.call(_timed, one)


def _record(
    result: Result, key: tuple[str, str], rate: float, cpu: float, server_us: float
) -> None:
    """One client's round of one row: kept for the ratios, and the best round shown."""
    result.server_us.setdefault(key, []).append(server_us)
    result.per_round.setdefault(key, []).append((rate, cpu))
    if rate > result.rate.get(key, 0.0):
        result.rate[key] = rate
        result.cpu_us[key] = cpu


def _stream_round(result: Result, row: str, calls: int, streams: _StreamRow, server: Any) -> None:
    """One round of the stream row: one untimed turn, then ``_streams(calls)``
    turns, each one stream per client, the clients' order reversed every
    other turn, so that the machine's slow and fast moments fall on every
    client alike."""
    for client in CLIENTS:  # the connections sat idle through the unary rows
        streams.turn(client)  # one untimed stream each, like a unary round's warm-up call
    spent: dict[str, list[tuple[Spent, float]]] = {client: [] for client in CLIENTS}
    for turn in range(_streams(calls)):
        for client in CLIENTS if turn % 2 == 0 else CLIENTS[::-1]:
            before = cpu_seconds(server)
            one = streams.turn(client)
            spent[client].append((one, cpu_seconds(server) - before))
    for client, turns in spent.items():
        count = sum(one.calls for one, _ in turns)
        assert count == _row_calls(row, calls), (client, count)
        wall = sum(one.wall for one, _ in turns)
        cpu = sum(one.cpu for one, _ in turns)
        server_cpu = sum(server for _, server in turns)
        _record(result, (row, client), count / wall, cpu / count * 1e6, server_cpu / count * 1e6)


def _row_calls(row: str, calls: int) -> int:
    """How many calls (or stream messages) one round of ``row`` makes."""
    if row.startswith("unary"):
        concurrency = int(row.rsplit("c=", 1)[1])
        return max(1, calls // concurrency) * concurrency
    return _streams(calls) * STREAM_MESSAGES


def _streams(calls: int) -> int:
    """Streams of the stream row per round: one per 200 unary calls of a row."""
    return max(1, calls // 200)


def _measure(client: str, port: int, row: str, calls: int) -> tuple[float, float]:
    """(rate per second, CPU microseconds per call) of one round of one client
    in a unary row."""
    if client == "nadisc.grpc, trio":
        spent = anyio.run(_ours, port, row, calls, backend="trio")
    elif client == "nadisc.grpc, asyncio":
        spent = anyio.run(_ours, port, row, calls, backend="asyncio")
    elif client == "grpclib":
        spent = asyncio.run(_grpclib(port, row, calls))
    else:
        spent = asyncio.run(_grpcio(port, row, calls))
    return spent.calls / spent.wall, spent.cpu / spent.calls * 1e6


async def _sweep(port: int, waits: list[float | None], pairs: int, server: Any) -> list[Swept]:
    """One loop's ``--sweep``: a channel per wait, one stream at a time on each in turn."""
    swept = [Swept(wait) for wait in waits]
    async with contextlib.AsyncExitStack() as stack:
        ones = []
        for wait in waits:
            options = {"receive_coalescing": wait}
            one = await stack.enter_async_context(_stream_client("nadisc.grpc", port, options))
            await one()  # connect and warm up, untimed
            ones.append(one)
        for pair in range(pairs):
            order = range(len(waits)) if pair % 2 == 0 else range(len(waits) - 1, -1, -1)
            for index in order:
                server_before = cpu_seconds(server)
                spent = await _timed(ones[index])
                assert spent.calls == STREAM_MESSAGES, spent
                swept[index].streams.append((spent.wall, spent.cpu))
                swept[index].server_cpu += cpu_seconds(server) - server_before
    return swept


def _print_sweep(loop: str, swept: list[Swept]) -> None:
    """One loop's ``--sweep`` table: each wait against the first one given."""
    pairs = len(swept[0].streams)
    print(
        f"receive coalescing on {loop}: {pairs} pairs of {STREAM_MESSAGES}-message streams, "
        "one stream at a time on one channel per wait in turn"
    )
    first = "off" if swept[0].wait is None else f"{swept[0].wait * 1e6:g} us"
    print(
        f"{'wait':<8}{'stream ms':>11}{f'rate / {first}':>16}{'p25-p75':>13}"
        f"{'client us/msg':>15}{'server us/msg':>15}"
    )
    messages = pairs * STREAM_MESSAGES
    for entry in swept:
        name = "off" if entry.wait is None else f"{entry.wait * 1e6:g} us"
        ratios = entry.throughput_over(swept[0])
        wall = statistics.median(w for w, _ in entry.streams) * 1e3
        cpu = sum(c for _, c in entry.streams) / messages * 1e6
        server = entry.server_cpu / messages * 1e6
        quartiles = f"{ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}"
        print(
            f"{name:<8}{wall:>11.1f}{statistics.median(ratios):>16.3f}{quartiles:>13}"
            f"{cpu:>15.1f}{server:>15.1f}"
        )
    print()


def _waits(text: str) -> list[float | None]:
    """``--sweep``: waits separated by commas, each as ``--coalescing`` takes it."""
    return [_coalescing(part.strip())[0] for part in text.split(",")]


def _coalescing(text: str) -> tuple[float | None]:
    """``--coalescing``: 'off' or seconds, as the channel checks them."""
    from nadisc.grpc import Channel

    try:
        value = None if text == "off" else float(text)
        Channel("127.0.0.1:1", receive_coalescing=value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"'off' or seconds: {exc}") from None
    return (value,)


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few calls per row, one round")
    parser.add_argument("--calls", type=int, default=2048, help="unary calls per row and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--coalescing",
        type=_coalescing,
        default=None,
        help="the channel's receive_coalescing: 'off', or seconds (default: its own, 80e-6)",
    )
    parser.add_argument(
        "--sweep",
        type=_waits,
        default=None,
        help="only compare receive_coalescing waits, e.g. off,40e-6,80e-6 (see the docstring)",
    )
    parser.add_argument(
        "--pairs", type=int, default=SWEEP_PAIRS, help="--sweep: stream pairs per loop"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve())
        return Result(0, 0)
    calls, rounds = (32, 1) if args.smoke else (args.calls, args.rounds)
    if args.sweep is not None:
        result = Result(calls, 0)
        pairs = 2 if args.smoke else args.pairs
        argv = [sys.executable, "-m", "benchmarks.grpc_throughput", "--serve"]
        with serving_process(argv) as ((port,), server):
            # The server's first streams are slower: warm it up, untimed.
            untimed: list[float | None] = [None]
            anyio.run(_sweep, port, untimed, 2 if args.smoke else 10, server, backend="trio")
            for loop in ("trio", "asyncio"):
                swept = anyio.run(_sweep, port, args.sweep, pairs, server, backend=loop)
                result.sweep[loop] = swept
                _print_sweep(loop, swept)
        load = os.getloadavg()
        print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (2 cores, shared machine)")
        return result
    if args.coalescing is not None:
        _CHANNEL_OPTIONS["receive_coalescing"] = args.coalescing[0]
        print(f"nadisc.grpc with receive_coalescing={args.coalescing[0]}")
    rows = ["unary c=1", "unary c=16", "unary c=64", f"stream {STREAM_MESSAGES} msgs"]
    result = Result(calls, rounds, rows=rows)
    argv = [sys.executable, "-m", "benchmarks.grpc_throughput", "--serve"]
    with serving_process(argv) as ((port,), server), contextlib.ExitStack() as stack:
        if not args.smoke:
            for client in CLIENTS:  # imports and first connections, outside the timing
                _measure(client, port, rows[0], 8)
        streams = _StreamRow(port, stack)
        for _ in range(rounds):
            for row in rows:
                if row.startswith("stream"):
                    _stream_round(result, row, calls, streams, server)
                    continue
                for client in CLIENTS:
                    before = cpu_seconds(server)
                    rate, cpu = _measure(client, port, row, calls)
                    server_us = (cpu_seconds(server) - before) / _row_calls(row, calls) * 1e6
                    _record(result, (row, client), rate, cpu, server_us)
    _print(result)
    unary_floor, stream_floor = h2_floor_us(calls)
    result.h2_floor_us = (unary_floor, stream_floor)
    print(
        f"h2 alone (the channel's h2 work, in memory, no I/O): {unary_floor:.0f} us of client "
        f"CPU per unary call, {stream_floor:.1f} us per stream message"
    )
    return result


def _print(result: Result) -> None:
    load = os.getloadavg()
    print(
        f"gRPC throughput: {result.calls} unary calls per row and round, "
        f"{result.rounds} round(s), best round shown; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (2 cores, shared machine)"
    )
    header = f"{'row':<18}" + "".join(f"{c:>26}" for c in CLIENTS)
    print(header)
    for row in result.rows:
        cells = []
        for client in CLIENTS:
            rate = result.rate[(row, client)]
            cpu_us = result.cpu_us[(row, client)]
            cells.append(f"{rate:>10.0f}/s {cpu_us:>7.0f} us cpu")
        print(f"{row:<18}" + "".join(f"{c:>26}" for c in cells))
    print()
    print(
        "ratios: the median over rounds of each round's ratio (lowest-highest round); "
        "cpu is client CPU per call, lower is better"
    )
    pairs = (
        ("trio/grpclib", CLIENTS[0], "grpclib", False),
        ("asyncio/grpclib", CLIENTS[1], "grpclib", False),
        ("trio/grpcio", CLIENTS[0], "grpcio.aio", False),
        ("asyncio/grpcio", CLIENTS[1], "grpcio.aio", False),
        ("trio/asyncio", CLIENTS[0], CLIENTS[1], False),
        ("cpu trio/grpclib", CLIENTS[0], "grpclib", True),
        ("cpu asyncio/grpclib", CLIENTS[1], "grpclib", True),
    )
    print(f"{'row':<18}" + "".join(f"{name:>21}" for name, *_ in pairs))
    for row in result.rows:
        cells = []
        for _, top, bottom, cpu in pairs:
            ratios = result.ratios(row, top, bottom, cpu=cpu)
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"{row:<18}" + "".join(f"{c:>21}" for c in cells))
    print()
    print(
        "server CPU per call (or message), median round, us; beside it the server's "
        "busy share of one core (rate x CPU): near 1.0 the row is paced by the server"
    )
    print(f"{'row':<18}" + "".join(f"{c:>26}" for c in CLIENTS))
    for row in result.rows:
        cells = []
        for client in CLIENTS:
            per_call = statistics.median(result.server_us[(row, client)])
            busy = statistics.median(
                rate * us / 1e6
                for (rate, _), us in zip(
                    result.per_round[(row, client)], result.server_us[(row, client)], strict=True
                )
            )
            cells.append(f"{per_call:>8.1f} us  {busy:>4.2f} core")
        print(f"{row:<18}" + "".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    main()
