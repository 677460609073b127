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
    defaults: receive coalescing on (40 us; ``--coalescing off`` or
    ``--coalescing SECONDS`` to compare).
``grpclib``
    ``grpclib.client.Channel`` with ``UnaryUnaryMethod`` /
    ``UnaryStreamMethod`` (asyncio; h2 underneath too).
``grpcio.aio``
    ``grpc.aio.insecure_channel`` multicallables (asyncio; the C core).

Each cell is the best round's wall-clock rate and, beside it, the client
process's CPU time per call (``time.process_time``; for the stream row, per
message), both timed over the row's calls alone: each client's round starts
its loop, connects and makes one warm-up call before the timing starts, and
closes the channel after it ends. The server's CPU is in another process
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

Run: ``python -m benchmarks.grpc_throughput [--smoke] [--calls N] [--rounds R]
[--coalescing off|SECONDS]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio

from benchmarks._grpc_server import cpu_seconds, serving_process

UNARY = "/bench.Bench/Unary"
STREAM = "/bench.Bench/Stream"
REQUEST = b"0123456789"
STREAM_MESSAGES = 1000

CLIENTS = ("nadisc.grpc, trio", "nadisc.grpc, asyncio", "grpclib", "grpcio.aio")
#: Keywords for nadisc.grpc.Channel beyond its defaults (``--coalescing``).
_CHANNEL_OPTIONS: dict[str, Any] = {}


class Spent(NamedTuple):
    """One client's round of one row: calls (or messages), wall and CPU seconds."""

    calls: int
    wall: float
    cpu: float


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
        stream = channel.unary_stream(STREAM)
        await unary(REQUEST)  # connect outside the timing
        return await _run_row(row, calls, lambda: unary(REQUEST), lambda: stream(REQUEST))


async def _grpclib(port: int, row: str, calls: int) -> Spent:
    from grpclib.client import Channel, UnaryStreamMethod, UnaryUnaryMethod

    channel = Channel("127.0.0.1", port)
    try:
        unary = UnaryUnaryMethod(channel, UNARY, Raw, Raw)
        stream = UnaryStreamMethod(channel, STREAM, Raw, Raw)
        await unary(Raw(REQUEST))

        async def stream_call() -> Any:
            async with stream.open() as call:
                await call.send_message(Raw(REQUEST), end=True)
                return [m async for m in call]

        return await _run_row(row, calls, lambda: unary(Raw(REQUEST)), stream_call, aiter=False)
    finally:
        channel.close()


async def _grpcio(port: int, row: str, calls: int) -> Spent:
    import grpc.aio

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary: Any = channel.unary_unary(UNARY)
        stream: Any = channel.unary_stream(STREAM)
        await unary(REQUEST)
        return await _run_row(row, calls, lambda: unary(REQUEST), lambda: stream(REQUEST))


async def _run_row(
    row: str,
    calls: int,
    unary: Callable[[], Awaitable[Any]],
    stream: Callable[[], Any],
    *,
    aiter: bool = True,
) -> Spent:
    """Run one row on a connected channel: how many calls (or messages) it
    made, and the wall and process CPU seconds they took. The timing starts
    here, so the event loop's start, the connection and the warm-up call
    before it, and the channel's close after it, are not in it."""
    cpu, wall = time.process_time(), time.perf_counter()
    if row.startswith("unary"):
        await _fan(int(row.rsplit("c=", 1)[1]), calls, unary)
        count = _row_calls(row, calls)
    else:
        count = 0
        for _ in range(_streams(calls)):
            if aiter:
                async for _message in stream():
                    count += 1
            else:
                count += len(await stream())
    return Spent(count, time.perf_counter() - wall, time.process_time() - cpu)


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
    """(rate per second, CPU microseconds per call) of one round of one client."""
    if client == "nadisc.grpc, trio":
        spent = anyio.run(_ours, port, row, calls, backend="trio")
    elif client == "nadisc.grpc, asyncio":
        spent = anyio.run(_ours, port, row, calls, backend="asyncio")
    elif client == "grpclib":
        spent = asyncio.run(_grpclib(port, row, calls))
    else:
        spent = asyncio.run(_grpcio(port, row, calls))
    return spent.calls / spent.wall, spent.cpu / spent.calls * 1e6


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
        help="the channel's receive_coalescing: 'off', or seconds (default: its own, 40e-6)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve())
        return Result(0, 0)
    calls, rounds = (32, 1) if args.smoke else (args.calls, args.rounds)
    if args.coalescing is not None:
        _CHANNEL_OPTIONS["receive_coalescing"] = args.coalescing[0]
        print(f"nadisc.grpc with receive_coalescing={args.coalescing[0]}")
    rows = ["unary c=1", "unary c=16", "unary c=64", f"stream {STREAM_MESSAGES} msgs"]
    result = Result(calls, rounds, rows=rows)
    argv = [sys.executable, "-m", "benchmarks.grpc_throughput", "--serve"]
    with serving_process(argv) as ((port,), server):
        if not args.smoke:
            for client in CLIENTS:  # imports and first connections, outside the timing
                _measure(client, port, rows[0], 8)
        for _ in range(rounds):
            for row in rows:
                for client in CLIENTS:
                    before = cpu_seconds(server)
                    rate, cpu = _measure(client, port, row, calls)
                    served = _row_calls(row, calls)
                    key = (row, client)
                    result.server_us.setdefault(key, []).append(
                        (cpu_seconds(server) - before) / served * 1e6
                    )
                    result.per_round.setdefault(key, []).append((rate, cpu))
                    if rate > result.rate.get(key, 0.0):
                        result.rate[key] = rate
                        result.cpu_us[key] = cpu
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
