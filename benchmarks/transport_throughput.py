"""Requests per second through discovery, next to plain httpx, in one trio run.

An owner with one connection lists three instances of the service ``bench``
(a static-evidence in-memory listing), so every request through discovery
goes through the evidence check, the streaming balance (round robin over
the three), the currency re-check and the guarded response body. The
clients, interleaved in rounds (every client runs once per round, in the
same order), on trio and on asyncio (one table per loop). Each ratio is the
median over the rounds of that round's rate divided by its baseline's rate in
the same round; the rates shown are each client's median round:

In memory (the pool answers at once, so the difference between the rows is
what the discovery layer itself costs per request):

``plain httpx``
    ``httpx.AsyncClient(transport=pool)`` — the baseline: plain httpx, with
    nothing added.
``discovery transport``
    ``httpx.AsyncClient(mounts={"nadisc://": DiscoveryTransport(owner,
    transport=pool)})`` to ``nadisc://primary/bench/``. Target: at least
    0.8 of the baseline.
``owner.rest()``
    ``RestDiscoveryClient(owner, "primary", transport=pool)`` — the client
    ``owner.rest()`` returns, over the same pool — ``rest.get("/",
    service="bench")``. Target: no slower than the transport.
``plain httpx, pool called directly`` (for information)
    ``build_request`` then ``pool.handle_async_request`` and ``aread``: the
    least plain httpx can do per request, without ``AsyncClient.send``'s
    auth flow, redirect handling, event hooks and cookie jar. ``owner.rest()``
    hands a discovery call to the transport this way (its own client has
    none of those set), which is why it can beat the baseline row; this row
    is its like-for-like comparison.
``plain httpx, MockTransport``
    ``httpx.AsyncClient(transport=httpx.MockTransport(handler))`` with a
    synchronous handler (the form httpx's documentation shows): the
    baseline of the next row, with httpx's own mock pool.
``discovery transport, MockTransport``
    The transport over the same ``httpx.MockTransport``: it calls the
    handler as the mock pool does, and a synchronous handler cannot wait,
    so no cancel scope bounds it. Target: at least 0.8 of the row above.
``plain httpx, MockTransport, async handler`` and ``discovery transport,
async handler`` (for information)
    The same pair with an ``async def`` handler: its answer can wait, so the
    transport awaits it inside a cancel scope bounding the call's budget.

The in-memory pool answers without waiting, so it meets any timeout it is
handed, and says so (``nadisc_enforces_timeouts = True``) as httpx's own
pool does by applying the timeout extension to every operation.

Over loopback (three keep-alive HTTP/1.1 backends in this process on
127.0.0.1, answering at once; plain httpx calls the first): plain httpx,
the discovery transport and ``owner.rest()`` against them; the backends'
cost is in every number.

In-memory rates are requests per CPU second of this process
(``time.process_time``): nothing there waits, and the machine may be shared
with work that would show up as noise in wall-clock rates. Loopback rates
are wall-clock requests per second (the waiting for the socket is the point
there); both columns are printed for every row.

The load average of the machine is printed with every table (the rates are
only comparable within one run).

Run: ``python -m benchmarks.transport_throughput [--smoke] [--requests N]
[--rounds R] [--concurrency C] [--loop trio|asyncio|both]
[--groups memory,mock,loopback]`` (``--groups`` leaves out the other rows;
a ratio is printed only when its baseline was measured).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import anyio
import httpx

from nadisc import (
    ConnectionConfig,
    ConnectionSpec,
    DiscoveryTransport,
    EvidenceKind,
    OwnerBuilder,
    RestDiscoveryClient,
)
from nadisc.demo import Backend
from nadisc.testing import MemoryProvider

TARGET_MEMORY_RATIO = 0.8
TARGET_LOOPBACK_RATIO = 0.85
SERVICE = "bench"
ENDPOINTS = 3
LOOPS = ("trio", "asyncio")
GROUPS = ("memory", "mock", "loopback")

Call = Callable[[], Awaitable[httpx.Response]]


class InMemoryPool(httpx.AsyncBaseTransport):
    """Answers every request at once from memory (never waits, so meets any timeout)."""

    nadisc_enforces_timeouts = True

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"bench")


def _answer(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=b"bench")


async def _answer_async(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=b"bench")


async def _direct(
    client: httpx.AsyncClient, pool: httpx.AsyncBaseTransport, url: str
) -> httpx.Response:
    """Plain httpx at its least: a built request handed to the pool, the body read."""
    request = client.build_request("GET", url)
    response = await pool.handle_async_request(request)
    response.request = request
    await response.aread()
    return response


async def _drive(call: Call, requests: int, concurrency: int) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) for ``requests`` calls."""
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            response = await call()
            if response.status_code != 200:
                raise RuntimeError(f"unexpected status {response.status_code}")

    start = time.process_time()
    wall = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    return time.process_time() - start, time.perf_counter() - wall


@dataclass(frozen=True)
class Result:
    requests: int
    concurrency: int
    #: The event loop the run used.
    loop: str = "trio"
    #: ``os.getloadavg()`` at the end of the run.
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    #: Requests per CPU second per row name (median round).
    cpu_rps: dict[str, float] = field(default_factory=dict)
    #: Wall-clock requests per second per row name (median round).
    wall_rps: dict[str, float] = field(default_factory=dict)
    #: Per row name, its rate in each round (CPU rate in memory, wall over
    #: loopback), in round order: the ratios pair them round by round.
    rounds: dict[str, list[float]] = field(default_factory=dict)

    @property
    def rps(self) -> dict[str, float]:
        """The rate each ratio uses: CPU for in-memory rows, wall clock for loopback."""
        return {
            name: (self.wall_rps if name.startswith("loopback") else self.cpu_rps)[name]
            for name in self.cpu_rps
        }

    def ratio(self, row: str, baseline: str) -> float:
        """The median over the rounds of ``row``'s rate / ``baseline``'s rate that round."""
        pairs = zip(self.rounds[row], self.rounds[baseline], strict=True)
        return statistics.median(mine / theirs for mine, theirs in pairs)

    @property
    def memory_ratio(self) -> float:
        return self.ratio("memory transport", "memory plain")

    @property
    def mock_ratio(self) -> float:
        return self.ratio("mock transport", "mock plain")

    @property
    def rest_vs_transport(self) -> float:
        return self.ratio("memory rest", "memory transport")

    @property
    def rest_vs_direct(self) -> float:
        return self.ratio("memory rest", "memory direct")

    @property
    def loopback_ratio(self) -> float:
        return self.ratio("loopback transport", "loopback plain")

    @property
    def overhead_us(self) -> float:
        """What the discovery transport adds per request in memory, in microseconds."""
        return (1 / self.rps["memory transport"] - 1 / self.rps["memory plain"]) * 1e6


async def measure(
    requests: int,
    rounds: int,
    concurrency: int,
    loop: str = "trio",
    groups: tuple[str, ...] = GROUPS,
) -> Result:
    backends = [Backend(f"bench-{n}", 0.0) for n in range(ENDPOINTS)]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with anyio.create_task_group() as servers:
        for backend in backends:
            await servers.start(backend.serve)
        registry = MemoryProvider(evidence=EvidenceKind.STATIC_FACT)
        registry.set(SERVICE, [backend.instance() for backend in backends])
        builder = OwnerBuilder().connection(
            ConnectionSpec("primary", registry, ConnectionConfig(provider="memory"))
        )
        async with builder.open() as owner:
            await owner.prepare(anyio.current_time() + 5)
            pool = InMemoryPool()
            through_url = f"nadisc://primary/{SERVICE}/"
            plain_url = backends[0].url + "/"
            mock = httpx.MockTransport(_answer)
            mock_async = httpx.MockTransport(_answer_async)
            async with (
                httpx.AsyncClient(transport=pool) as memory_plain,
                DiscoveryTransport(owner, transport=pool) as in_memory,
                httpx.AsyncClient(mounts={"nadisc://": in_memory}) as memory_through,
                RestDiscoveryClient(owner, "primary", transport=pool) as memory_rest,
                httpx.AsyncClient(transport=mock) as mock_plain,
                DiscoveryTransport(owner, transport=mock) as scoped,
                httpx.AsyncClient(mounts={"nadisc://": scoped}) as mock_through,
                httpx.AsyncClient(transport=mock_async) as async_plain,
                DiscoveryTransport(owner, transport=mock_async) as async_scoped,
                httpx.AsyncClient(mounts={"nadisc://": async_scoped}) as async_through,
                httpx.AsyncClient(limits=limits) as loop_plain,
                DiscoveryTransport(owner, limits=limits) as loop_transport,
                httpx.AsyncClient(mounts={"nadisc://": loop_transport}) as loop_through,
            ):
                loop_rest = owner.rest()
                rows: dict[str, Call] = {
                    "memory plain": lambda: memory_plain.get(plain_url),
                    "memory transport": lambda: memory_through.get(through_url),
                    "memory rest": lambda: memory_rest.get("/", service=SERVICE),
                    "memory direct": partial(_direct, memory_plain, pool, plain_url),
                    "mock plain": lambda: mock_plain.get(plain_url),
                    "mock transport": lambda: mock_through.get(through_url),
                    "mock async plain": lambda: async_plain.get(plain_url),
                    "mock async transport": lambda: async_through.get(through_url),
                    "loopback plain": lambda: loop_plain.get(plain_url),
                    "loopback transport": lambda: loop_through.get(through_url),
                    "loopback rest": lambda: loop_rest.get("/", service=SERVICE),
                }
                rows = {name: call for name, call in rows.items() if name.split()[0] in groups}
                warm = min(requests // 2, 500)
                for call in rows.values():
                    await _drive(call, warm, concurrency)
                cpu_rates: dict[str, list[float]] = {name: [] for name in rows}
                wall_rates: dict[str, list[float]] = {name: [] for name in rows}
                for _ in range(rounds):
                    for name, call in rows.items():
                        # Every row starts with the collector's counts at
                        # zero: a full collection owed to earlier rows (long
                        # under a test runner's heap) lands in none of them.
                        gc.collect()
                        cpu, wall = await _drive(call, requests, concurrency)
                        cpu_rates[name].append(requests / cpu)
                        wall_rates[name].append(requests / wall)
        servers.cancel_scope.cancel()
    return Result(
        requests=requests,
        concurrency=concurrency,
        loop=loop,
        load=os.getloadavg(),
        cpu_rps={name: statistics.median(rates) for name, rates in cpu_rates.items()},
        wall_rps={name: statistics.median(rates) for name, rates in wall_rates.items()},
        rounds={
            name: wall_rates[name] if name.startswith("loopback") else cpu_rates[name]
            for name in rows
        },
    )


_LABELS = (
    ("memory plain", "plain httpx, in-memory pool", "memory plain"),
    ("memory transport", "discovery transport, in-memory pool", "memory plain"),
    ("memory rest", "owner.rest(), in-memory pool", "memory plain"),
    ("memory direct", "plain httpx, pool called directly", "memory plain"),
    ("mock plain", "plain httpx, MockTransport", "mock plain"),
    ("mock transport", "discovery transport, MockTransport", "mock plain"),
    ("mock async plain", "plain httpx, MockTransport, async handler", "mock async plain"),
    ("mock async transport", "discovery transport, async handler", "mock async plain"),
    ("loopback plain", "plain httpx, loopback", "loopback plain"),
    ("loopback transport", "discovery transport, loopback", "loopback plain"),
    ("loopback rest", "owner.rest(), loopback", "loopback plain"),
)


def format_table(result: Result) -> str:
    rows = [(f"client ({result.loop})", "req/CPU-s", "req/s wall", "ratio")]
    rules = []
    group = None
    for key, label, baseline in _LABELS:
        if key not in result.cpu_rps:
            continue
        if group is not None and key.split()[0] != group:
            rules.append(len(rows) - 1)
        group = key.split()[0]
        rows.append(
            (
                label,
                f"{result.cpu_rps[key]:,.0f}",
                f"{result.wall_rps[key]:,.0f}",
                f"{result.ratio(key, baseline):.2f}",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    lines = []
    for n, row in enumerate(rows):
        lines.append(
            f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}"
            f"  {row[3]:>{widths[3]}}"
        )
        if n == 0 or n in rules:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(
        "ratios: in memory by CPU time, over loopback by wall clock; "
        f"median of {len(next(iter(result.rounds.values())))} per-round ratios"
    )
    if "memory plain" in result.cpu_rps:
        lines.append(
            f"in memory the discovery transport adds about {result.overhead_us:,.0f} us per "
            f"request; ratio {result.memory_ratio:.2f} (target >= {TARGET_MEMORY_RATIO}); "
            f"owner.rest() / transport {result.rest_vs_transport:.2f} (target >= 1.0)"
        )
        lines.append(
            f"owner.rest() / plain httpx calling the pool directly {result.rest_vs_direct:.2f} "
            "(for information: the like-for-like path)"
        )
    if "mock plain" in result.cpu_rps:
        lines.append(
            f"MockTransport ratio {result.mock_ratio:.2f} (target >= {TARGET_MEMORY_RATIO}); "
            f"{ENDPOINTS} endpoints, round robin"
        )
    if "loopback plain" in result.cpu_rps:
        lines.append(
            f"loopback ratio {result.loopback_ratio:.2f} (target >= {TARGET_LOOPBACK_RATIO})"
        )
    lines.append(f"{result.requests:,} requests per round, concurrency {result.concurrency}")
    one, five, fifteen = result.load
    lines.append(f"load average {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="a few hundred requests, one round")
    parser.add_argument("--requests", type=int, default=5000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per client")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent callers")
    parser.add_argument(
        "--loop", choices=(*LOOPS, "both"), default="both", help="event loop (default: both)"
    )
    parser.add_argument(
        "--groups",
        default=",".join(GROUPS),
        help=f"comma-separated row groups to run (default: {','.join(GROUPS)})",
    )
    args = parser.parse_args(argv)
    groups = tuple(args.groups.split(","))
    unknown = set(groups) - set(GROUPS)
    if unknown:
        parser.error(f"unknown group(s): {', '.join(sorted(unknown))}")
    requests, rounds = (150, 1) if args.smoke else (args.requests, args.rounds)
    results = []
    for loop in LOOPS if args.loop == "both" else (args.loop,):
        result: Result = anyio.run(
            measure, requests, rounds, args.concurrency, loop, groups, backend=loop
        )
        print(format_table(result), end="\n\n", flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
