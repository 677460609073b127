"""Unary gRPC calls per second through the discovery channel (3 instances) vs a plain channel.

Three grpcio servers (each the ``--serve`` process of
:mod:`benchmarks.grpc_throughput`: a 10-byte request, a 10-byte response,
raw bytes) are listed by an in-memory registry. Clients, on trio, in one
process, interleaved round by round:

``plain Channel, 1 instance``
    ``nadisc.grpc.Channel`` to the first server: one HTTP/2 connection, no
    pick (the fastest honest alternative: what a caller would use without
    discovery).
``discovery, N, policy``
    ``nadisc.grpc.discovery_channel``: a poise pick per call (round robin,
    or P2C + PeakEwma), the observation's currency check, one subchannel per
    instance. With one instance listed (the plain channel's server) the row
    isolates the cost of the pick; with three, it adds spreading the calls
    over three connections and three server processes.
``plain Channels, 3, by hand`` (for information)
    Three plain ``Channel`` objects, one per instance, taken in turn by a
    hand loop (``itertools.cycle``): spreading the calls over the same three
    connections with nothing else, so ``discovery, 3, round robin`` over it
    is what discovery itself costs once the spreading is paid for.

Rows: unary at concurrency 1 and 16 (that many tasks calling in turn). Each
cell is the best round's rate and the least client-process CPU time per
call (``time.process_time``; the servers are other processes). The ratios
are over the plain channel to one instance (target >= 0.9 for discovery
with three instances): best round over best round, and
the median over rounds of the ratio within a round (steadier while other
work on the machine comes and goes). Each round starts with another
client. On a 2-core machine three busy server processes compete with the
client for the cores, which one server does not: the CPU column shows
what the client itself pays. The load average is printed with the table.

With ``--one-server`` the three instances are the plain channel's one
server listed three times (three connections, one server process): the
rows then differ only in what the client does, with the server's cost the
same for every column.

Run: ``python -m benchmarks.grpc_discovery [--smoke] [--calls N] [--rounds R] [--one-server]``
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from benchmarks._grpc_server import serving
from benchmarks.grpc_throughput import REQUEST, UNARY, _fan

CLIENTS = (
    "plain Channel, 1 instance",
    "discovery, 1, round robin",
    "discovery, 3, round robin",
    "discovery, 3, P2C+PeakEwma",
    "plain Channels, 3, by hand",
)
#: The hand round robin over three plain channels (no discovery, no balance).
HAND = CLIENTS[4]
ROWS = ("unary c=1", "unary c=16")


@dataclass
class Result:
    calls: int
    rounds: int
    #: The three instances are one server process listed three times.
    one_server: bool = False
    #: (row, client) -> best calls per second
    rate: dict[tuple[str, str], float] = field(default_factory=dict)
    #: (row, client) -> least client-process CPU microseconds per call
    cpu_us: dict[tuple[str, str], float] = field(default_factory=dict)
    #: (row, client) -> the rate of every round, in order
    rounds_rate: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def ratio(self, row: str, client: str) -> float:
        """Best round over best round."""
        return self.rate[(row, client)] / self.rate[(row, CLIENTS[0])]

    def round_ratio(self, row: str, client: str, base: str = CLIENTS[0]) -> float:
        """The median over rounds of the client's rate over ``base``'s (the
        plain channel's), same round."""
        mine, plain = self.rounds_rate[(row, client)], self.rounds_rate[(row, base)]
        return statistics.median(a / b for a, b in zip(mine, plain, strict=True))


def _server(stack: ExitStack) -> int:
    (port,) = stack.enter_context(
        serving([sys.executable, "-m", "benchmarks.grpc_throughput", "--serve"])
    )
    return port


async def _rounds(ports: list[int], calls: int, rounds: int, result: Result) -> None:
    from nadisc import ConnectionConfig, ConnectionSpec, Instance, OwnerBuilder, RestConfig
    from nadisc._grpc_protocol import GRPC_TLS_KEY
    from nadisc.grpc import Channel, discovery_channel
    from nadisc.testing import MemoryProvider

    instances = [
        Instance(f"s{i}", "127.0.0.1", port, metadata={GRPC_TLS_KEY: "plaintext"})
        for i, port in enumerate(ports)
    ]
    builder = OwnerBuilder()
    plans: tuple[tuple[str, Literal["round_robin", "p2c_peak_ewma"], list[Instance]], ...] = (
        ("one", "round_robin", instances[:1]),
        ("rr", "round_robin", instances),
        ("ewma", "p2c_peak_ewma", instances),
    )
    for name, strategy, listed in plans:
        memory = MemoryProvider(services={"bench": "bench"})
        memory.set("bench", listed)
        config = ConnectionConfig(provider="memory", rest=RestConfig(lb_strategy=strategy))
        builder.connection(ConnectionSpec(name, memory, config))
    async with builder.open() as owner:
        await owner.prepare(anyio.current_time() + 10)
        async with (
            Channel(f"127.0.0.1:{ports[0]}") as plain,
            discovery_channel(owner, "one", "bench") as one,
            discovery_channel(owner, "rr", "bench") as round_robin,
            discovery_channel(owner, "ewma", "bench") as ewma,
            Channel(f"127.0.0.1:{ports[0]}") as first,
            Channel(f"127.0.0.1:{ports[1]}") as second,
            Channel(f"127.0.0.1:{ports[2]}") as third,
        ):
            by_hand = itertools.cycle([c.unary_unary(UNARY) for c in (first, second, third)])

            def hand(request: bytes) -> Any:
                return next(by_hand)(request)

            unaries: dict[str, Any] = {
                CLIENTS[0]: plain.unary_unary(UNARY),
                CLIENTS[1]: one.unary_unary(UNARY),
                CLIENTS[2]: round_robin.unary_unary(UNARY),
                CLIENTS[3]: ewma.unary_unary(UNARY),
                HAND: hand,
            }
            for unary in unaries.values():  # connect outside the timing
                for _ in range(6):
                    await unary(REQUEST)
            order = list(unaries)
            for n in range(rounds):
                for row in ROWS:
                    concurrency = int(row.rsplit("c=", 1)[1])
                    count = max(1, calls // concurrency) * concurrency
                    # Each round starts with another client: no column always runs first.
                    for client in order[n % len(order) :] + order[: n % len(order)]:
                        call = functools.partial(unaries[client], REQUEST)
                        start, cpu = time.perf_counter(), time.process_time()
                        await _fan(concurrency, calls, call)
                        rate = count / (time.perf_counter() - start)
                        cpu_us = (time.process_time() - cpu) / count * 1e6
                        key = (row, client)
                        result.rate[key] = max(rate, result.rate.get(key, 0.0))
                        result.cpu_us[key] = min(cpu_us, result.cpu_us.get(key, math.inf))
                        result.rounds_rate.setdefault(key, []).append(rate)


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few calls per row, one round")
    parser.add_argument("--calls", type=int, default=2048, help="unary calls per row and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--one-server",
        action="store_true",
        help="list the one server three times (three connections, one server process)",
    )
    args = parser.parse_args(argv)
    calls, rounds = (32, 1) if args.smoke else (args.calls, args.rounds)
    result = Result(calls, rounds, one_server=args.one_server)
    with ExitStack() as stack:
        if args.one_server:
            ports = [_server(stack)] * 3
        else:
            ports = [_server(stack) for _ in range(3)]
        anyio.run(_rounds, ports, calls, rounds, result, backend="trio")
    _print(result)
    return result


def _print(result: Result) -> None:
    load = os.getloadavg()
    print(
        f"gRPC through discovery: {result.calls} unary calls per row and round, "
        f"{result.rounds} round(s) interleaved, best round shown, trio; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (2 cores, shared machine); "
        + (
            "the 3 instances are ONE server process listed three times"
            if result.one_server
            else "3 instances, 3 server processes"
        )
    )
    print(f"{'row':<12}" + "".join(f"{c:>30}" for c in CLIENTS))
    for row in ROWS:
        cells = "".join(
            f"{result.rate[(row, c)]:>14.0f}/s {result.cpu_us[(row, c)]:>6.0f} us cpu"
            for c in CLIENTS
        )
        print(f"{row:<12}{cells}")
    print(f"{'row':<12}" + "".join(f"{c + ' / plain':>36}" for c in CLIENTS[1:]))
    for row in ROWS:
        cells = "".join(
            f"{f'{result.ratio(row, c):.2f} best, {result.round_ratio(row, c):.2f} median':>36}"
            for c in CLIENTS[1:]
        )
        print(f"{row:<12}{cells}")
    print(
        "(best: best round over best round; median: the median over rounds of the ratio "
        "within one round)"
    )
    spread = ", ".join(f"{row} {result.round_ratio(row, CLIENTS[2], HAND):.2f}" for row in ROWS)
    print(f"discovery, 3, round robin over the same three connections by hand (median): {spread}")


if __name__ == "__main__":
    main()
