"""The project's main job on an embedded default: ``python -m nadisc.demo``.

Four small HTTP backends start in this process on 127.0.0.1 (ephemeral
ports). An owner is opened with :func:`~nadisc.open_discovery` on an embedded
configuration (one connection, ``primary``, one service alias, ``orders``),
and an ``httpx.AsyncClient`` calls ``nadisc://primary/orders/...`` through a
:class:`~nadisc.DiscoveryTransport`. Each balancing strategy of the
connection's ``rest.lb_strategy`` (round robin, weighted, power of two
choices on peak EWMA) gets a run with fresh backends:

* after 30 % of the requests, ``beta`` becomes ten times slower;
* after 60 %, ``delta`` is drained: removed from the service's membership
  while requests are in flight.

Every request carries its sequence number in its path (``/work/<n>``,
numbered as issued) and each backend records the numbers that reached it, so
the drain is checked where it matters, at the backend: no request issued
after the drain may arrive at ``delta``. The table at the end shows the
requests each backend served, the errors (zero expected), client-side
p50/p99 latency, and how many requests issued after the drain arrived at
``delta`` (zero expected). ``main`` exits with status 1 when errors or
after-drain arrivals are not zero.

The static provider's listings are fixed for the owner's life, so the
connection is configured like a static one but backed by an in-memory
registry (:class:`~nadisc.testing.MemoryProvider`) that can change its
membership at runtime. Nothing leaves the machine; the tour takes a few
seconds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.abc
import httpx

from ._config import ConnectionConfig, DiscoveryConfig, RestConfig, StaticConfig
from ._instance import EvidenceKind, Instance
from ._owner import open_discovery
from ._transport import DiscoveryTransport
from .testing import MemoryProvider

__all__ = ["STRATEGIES", "Backend", "DemoResult", "StrategyRun", "main", "run_demo"]

SERVICE = "orders"
#: name, latency (seconds), weight (read by the weighted strategy).
BACKENDS: tuple[tuple[str, float, float], ...] = (
    ("alpha", 0.010, 2.0),
    ("beta", 0.015, 1.0),
    ("gamma", 0.020, 1.0),
    ("delta", 0.015, 1.0),
)
STRATEGIES: tuple[str, ...] = ("round_robin", "weighted", "p2c_peak_ewma")
DEGRADED = "beta"
DEGRADED_FACTOR = 10.0
DEGRADE_AT = 0.3
DRAINED = "delta"
DRAIN_AT = 0.6
_MAX_HEADER = 16 * 1024


@dataclass
class Backend:
    """One in-process HTTP backend: answers every request with its name after ``latency``."""

    name: str
    latency: float
    weight: float = 1.0
    port: int = 0
    served: int = 0
    #: Sequence numbers of the requests that arrived here, in arrival order.
    received: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def instance(self) -> Instance:
        return Instance(self.name, "127.0.0.1", self.port, weight=self.weight)

    async def handle(self, stream: anyio.abc.ByteStream) -> None:
        """Serve keep-alive HTTP/1.1 requests without bodies until the peer closes."""
        buffer = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buffer:
                    if len(buffer) > _MAX_HEADER:
                        return
                    try:
                        buffer += await stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        return
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                self.received.append(_sequence(head))
                if self.latency > 0:
                    await anyio.sleep(self.latency)
                self.served += 1
                body = self.name.encode()
                try:
                    await stream.send(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                    )
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener:
            task_status.started()
            await listener.serve(self.handle)


def _sequence(head: bytes) -> int:
    # "GET /orders/work/<n> HTTP/1.1" -> n (-1 for anything else).
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    last = parts[1].rsplit(b"/", 1)[-1] if len(parts) > 1 else b""
    return int(last) if last.isdigit() else -1


@dataclass
class StrategyRun:
    """What one strategy did."""

    strategy: str
    per_backend: dict[str, int]
    errors: int
    #: Requests handed to the drained backend's connection after the drain.
    sent_after_drain: int
    #: Requests issued after the drain that arrived at the drained backend.
    arrived_after_drain: int
    latencies: list[float] = field(repr=False)
    wall: float

    @property
    def problems(self) -> list[str]:
        """What broke the demo's invariants (empty: all held)."""
        found = []
        if self.errors:
            found.append(f"{self.strategy}: {self.errors} request(s) failed")
        if self.arrived_after_drain:
            found.append(
                f"{self.strategy}: {self.arrived_after_drain} request(s) issued after the "
                f"drain arrived at {DRAINED}"
            )
        return found

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        if not ordered:
            return 0.0
        rank = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
        return ordered[rank]

    @property
    def mean(self) -> float:
        return sum(self.latencies) / len(self.latencies) if self.latencies else 0.0

    @property
    def p50(self) -> float:
        return self.percentile(0.50)

    @property
    def p99(self) -> float:
        return self.percentile(0.99)


@dataclass
class DemoResult:
    requests: int
    runs: list[StrategyRun]

    @property
    def problems(self) -> list[str]:
        return [problem for run in self.runs for problem in run.problems]

    def table(self) -> str:
        names = [name for name, _, _ in BACKENDS]
        marks = {DEGRADED: "*", DRAINED: "+"}
        header = ["strategy", *(n + marks.get(n, "") for n in names)]
        header += ["errors", "mean ms", "p50 ms", "p99 ms", f"{DRAINED} after drain", "wall s"]
        rows = [header]
        for run in self.runs:
            rows.append(
                [
                    run.strategy,
                    *(str(run.per_backend.get(n, 0)) for n in names),
                    str(run.errors),
                    f"{run.mean * 1e3:.1f}",
                    f"{run.p50 * 1e3:.1f}",
                    f"{run.p99 * 1e3:.1f}",
                    str(run.arrived_after_drain),
                    f"{run.wall:.1f}",
                ]
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
        lines = []
        for n, row in enumerate(rows):
            cells = [row[0].ljust(widths[0])]
            cells += [cell.rjust(widths[c + 1]) for c, cell in enumerate(row[1:])]
            lines.append("  ".join(cells))
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        latency = {name: lat for name, lat, _ in BACKENDS}[DEGRADED]
        lines.append(
            f"* {DEGRADED} slows from {latency * 1e3:.0f} ms to "
            f"{latency * DEGRADED_FACTOR * 1e3:.0f} ms after {DEGRADE_AT:.0%} of the "
            f"{self.requests} requests"
        )
        lines.append(
            f"+ {DRAINED} is removed from the membership after {DRAIN_AT:.0%}; "
            f"'{DRAINED} after drain' counts requests issued after that which arrived at it"
        )
        weights = ", ".join(f"{name} {weight:g}" for name, _, weight in BACKENDS)
        lines.append(f"weights (read by 'weighted'): {weights}")
        return "\n".join(lines)


def embedded_config(backends: list[Backend], strategy: str) -> DiscoveryConfig:
    """The demo's discovery configuration: one static-style connection, ``primary``."""
    return DiscoveryConfig(
        enabled=True,
        connections={
            "primary": ConnectionConfig(
                provider="static",
                static=StaticConfig.model_validate(
                    {
                        "services": {
                            SERVICE: [
                                {"id": b.name, "host": "127.0.0.1", "port": b.port}
                                for b in backends
                            ]
                        }
                    }
                ),
                rest=RestConfig(lb_strategy=strategy),  # type: ignore[arg-type]
            )
        },
    )


def _drain(registry: MemoryProvider, backends: list[Backend]) -> None:
    """Remove the drained backend from the service's membership."""
    registry.set(SERVICE, [b.instance() for b in backends if b.name != DRAINED])


async def _run_strategy(
    strategy: str, *, requests: int, concurrency: int, say: Callable[[str], None]
) -> StrategyRun:
    backends = [Backend(name, latency, weight) for name, latency, weight in BACKENDS]
    async with anyio.create_task_group() as servers:
        for backend in backends:
            await servers.start(backend.serve)
        registry = MemoryProvider(evidence=EvidenceKind.STATIC_FACT, watch=True)
        registry.set(SERVICE, [b.instance() for b in backends])
        config = embedded_config(backends, strategy)
        async with open_discovery(config, providers={"primary": registry}) as owner:
            transport = DiscoveryTransport(owner)
            async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
                latencies: list[float] = []
                errors = 0
                issued = 0
                degrade_at = int(requests * DEGRADE_AT)
                drain_at = int(requests * DRAIN_AT)
                sent_at_drain: int | None = None
                step = max(1, requests // 4)
                started = anyio.current_time()

                def sent_to_drained() -> int:
                    route = transport.route("primary", SERVICE)
                    return 0 if route is None else route.statistics().sent.get(DRAINED, 0)

                async def worker() -> None:
                    nonlocal issued, errors, sent_at_drain
                    while issued < requests:
                        issued += 1
                        sequence = issued
                        if sequence == degrade_at:
                            slow = next(b for b in backends if b.name == DEGRADED)
                            slow.latency *= DEGRADED_FACTOR
                            say(f"[{strategy}] {DEGRADED} slows down ({slow.latency * 1e3:.0f} ms)")
                        if sequence == drain_at:
                            _drain(registry, backends)
                            sent_at_drain = sent_to_drained()
                            say(f"[{strategy}] {DRAINED} drained from the membership")
                        t0 = anyio.current_time()
                        try:
                            response = await http.get(f"nadisc://primary/{SERVICE}/work/{sequence}")
                            if response.status_code != 200:
                                errors += 1
                        except Exception as exc:
                            errors += 1
                            say(f"[{strategy}] request failed: {type(exc).__name__}: {exc}")
                        latencies.append(anyio.current_time() - t0)
                        if len(latencies) % step == 0:
                            say(
                                f"[{strategy}] {len(latencies)}/{requests} requests, "
                                f"{anyio.current_time() - started:.1f} s"
                            )

                async with anyio.create_task_group() as workers:
                    for _ in range(concurrency):
                        workers.start_soon(worker)
                wall = anyio.current_time() - started
                after_drain = sent_to_drained() - (sent_at_drain or 0)
        servers.cancel_scope.cancel()
    per_backend = {b.name: b.served for b in backends}
    drained = next(b for b in backends if b.name == DRAINED)
    # Requests numbered from drain_at on were issued once the drain was done.
    arrived = sum(1 for sequence in drained.received if sequence >= drain_at)
    return StrategyRun(strategy, per_backend, errors, after_drain, arrived, latencies, wall)


async def run_demo(
    requests: int = 2000,
    concurrency: int = 8,
    *,
    say: Callable[[str], None] = print,
) -> DemoResult:
    """Run every strategy against fresh backends and return what happened."""
    runs = [
        await _run_strategy(strategy, requests=requests, concurrency=concurrency, say=say)
        for strategy in STRATEGIES
    ]
    return DemoResult(requests, runs)


def main(requests: int = 2000, concurrency: int = 8, argv: list[str] | None = None) -> DemoResult:
    """Entry point of ``python -m nadisc.demo``; prints progress and a table.

    Returns the result when every invariant held; otherwise prints what broke
    and raises ``SystemExit(1)`` (the process exits with status 1).
    """
    if argv is not None:
        parser = argparse.ArgumentParser(prog="python -m nadisc.demo", description=__doc__)
        parser.add_argument("--requests", type=int, default=requests)
        parser.add_argument("--concurrency", type=int, default=concurrency)
        args = parser.parse_args(argv)
        requests, concurrency = args.requests, args.concurrency
    if requests < 20 or concurrency < 1:
        raise SystemExit("need --requests >= 20 and --concurrency >= 1")
    print(
        f"{len(BACKENDS)} in-process HTTP backends on 127.0.0.1; service {SERVICE!r} on "
        f"connection 'primary'; {requests} requests per strategy, {concurrency} concurrent "
        "callers through httpx + DiscoveryTransport"
    )
    print(
        "the connection is configured like a static one, but backed by an in-memory "
        "registry (MemoryProvider) so that its membership can change at runtime"
    )
    t0 = time.perf_counter()
    result: DemoResult = anyio.run(lambda: run_demo(requests, concurrency), backend="trio")
    print()
    print(result.table())
    print(f"\ndone in {time.perf_counter() - t0:.1f} s")
    problems = result.problems
    if problems:
        for problem in problems:
            print(f"FAILED: {problem}")
        raise SystemExit(1)
    print("invariants held: no errors, nothing issued after the drain reached it")
    return result


if __name__ == "__main__":
    import sys

    main(argv=sys.argv[1:])
