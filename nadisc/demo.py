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

A last part hosts the service itself: three instances served by
hypercorn through :mod:`nadisc.hosting` (ephemeral ports, registered
without ip/port into an in-memory registry) are rolled one by one (start
a replacement, then shut the old one down the way SIGTERM does) while
callers keep sending requests through the transport. The registry's
contents are published to the callers' connection every 20 ms, standing in
for a registry watch. Expected: no failed request, and no request reaching
an instance after its deregistration was acknowledged.

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
from typing import Any

import anyio
import anyio.abc
import httpx

from ._config import ConnectionConfig, DiscoveryConfig, RestConfig, StaticConfig
from ._instance import EvidenceKind, Instance
from ._owner import open_discovery
from ._transport import DiscoveryTransport
from .testing import MemoryProvider

__all__ = [
    "STRATEGIES",
    "Backend",
    "DemoResult",
    "RollingRun",
    "StrategyRun",
    "main",
    "rolling_config",
    "run_demo",
    "run_rolling",
]

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
    rolling: RollingRun | None = None

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


ROLLED = 3


@dataclass
class RollingRun:
    """What the rolling restart did."""

    requests: int
    errors: int
    #: Per replaced instance: requests that reached its app after its
    #: deregistration was acknowledged (0 expected).
    late: dict[str, int]
    #: Requests each instance's app handled.
    served: dict[str, int]
    refused: int
    wall: float

    @property
    def problems(self) -> list[str]:
        found = []
        if self.errors:
            found.append(f"rolling restart: {self.errors} request(s) failed")
        for name, count in self.late.items():
            if count:
                found.append(f"rolling restart: {count} request(s) reached {name} after it left")
        return found

    def table(self) -> str:
        names = list(self.served)
        header = ["instance", *names]
        rows = [
            header,
            ["served", *(str(self.served[n]) for n in names)],
            ["after deregistration", *(str(self.late.get(n, "-")) for n in names)],
        ]
        widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
        lines = []
        for n, row in enumerate(rows):
            cells = [row[0].ljust(widths[0])]
            cells += [cell.rjust(widths[c + 1]) for c, cell in enumerate(row[1:])]
            lines.append("  ".join(cells))
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append(
            f"{self.requests} requests, {self.errors} failed, {self.refused} answered 503 after "
            f"a deregistration (retried elsewhere by the caller), {self.wall:.1f} s"
        )
        return "\n".join(lines)


class _Instance:
    """A hosted demo instance: answers its name; records arrival times."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.arrivals: list[float] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = "startup" if message["type"] == "lifespan.startup" else "shutdown"
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        self.arrivals.append(anyio.current_time())
        await anyio.sleep(0.002)
        body = self.name.encode()
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def rolling_config() -> DiscoveryConfig:
    """A connection whose registrations land in an in-memory registry; the
    one registration has no ip/port (the host fills in the bound address)."""
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "memory",
                    "request_timeout_ms": 500,
                    "monitor_interval_ms": 500,
                    "observation_grace_ms": 3000,
                    "memory": {"services": {SERVICE: {"name": SERVICE}}},
                    "rest": {
                        "max_attempts": 4,
                        "retry_get_head_on_transport_error": True,
                        "retry_get_head_on_retryable_status": True,
                    },
                }
            },
            "registrations": {"web": {"service_name": SERVICE}},
            "shutdown_timeout_ms": 2000,
        }
    )


async def run_rolling(*, concurrency: int = 4, say: Callable[[str], None] = print) -> RollingRun:
    """Roll three hosted instances one by one under load (see the module docs)."""
    from .hosting import Host, serve
    from .testing import MemoryRegistry

    config = rolling_config()
    registry = MemoryRegistry()
    # The same connections without the registrations (a copy: a dump would
    # mask the memory provider's block, whose provider is not installed).
    caller_config = config.model_copy(update={"registrations": {}})
    listing = MemoryProvider(evidence=EvidenceKind.STATIC_FACT, watch=True)
    listing.set(SERVICE, [])
    apps: list[_Instance] = []
    counts = {"ok": 0, "errors": 0}
    late: dict[str, int] = {}
    refused = 0
    stop = anyio.Event()
    t0 = time.perf_counter()

    def publish() -> None:
        instances = []
        for instance_id in registry.instance_ids():
            stored = registry.get(instance_id)
            if stored is not None:
                record = stored.record
                instances.append(Instance(instance_id, record.host, record.port))
        listing.set(SERVICE, instances)

    async with anyio.create_task_group() as hosts:

        async def start(index: int) -> Host:
            app = _Instance(f"v{index}")
            apps.append(app)
            host: Host = await hosts.start(
                lambda task_status: serve(
                    app,
                    config,
                    providers={"primary": MemoryProvider(registry=registry)},
                    allow_loopback=True,
                    handle_signals=False,
                    drain_timeout_ms=2000,
                    task_status=task_status,
                )
            )
            publish()
            return host

        async def mirror() -> None:
            while True:
                publish()
                await anyio.sleep(0.02)

        running = [await start(i) for i in range(ROLLED)]
        hosts.start_soon(mirror)
        async with open_discovery(caller_config, providers={"primary": listing}) as caller:
            transport = DiscoveryTransport(caller)
            async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:

                async def send() -> None:
                    while not stop.is_set():
                        try:
                            answer = await http.get(f"nadisc://primary/{SERVICE}/work")
                            counts["ok" if answer.status_code == 200 else "errors"] += 1
                        except Exception:
                            counts["errors"] += 1

                async with anyio.create_task_group() as callers:
                    for _ in range(concurrency):
                        callers.start_soon(send)
                    await anyio.sleep(0.2)
                    for index in range(ROLLED):
                        old, old_app = running.pop(0), apps[index]
                        running.append(await start(ROLLED + index))
                        await anyio.sleep(0.2)
                        old.shutdown()
                        report = await old.wait_closed()
                        assert report.deregistered_at is not None
                        late[old_app.name] = sum(
                            1 for at in old_app.arrivals if at > report.deregistered_at
                        )
                        refused += report.refused_requests
                        say(
                            f"  rolled {old_app.name} -> v{ROLLED + index}: deregistered in "
                            f"{report.quiesce_seconds * 1e3:.1f} ms, drained in "
                            f"{report.drain_seconds * 1e3:.1f} ms"
                        )
                    await anyio.sleep(0.2)
                    stop.set()
        for host in running:
            host.shutdown()
        hosts.cancel_scope.cancel()
    return RollingRun(
        requests=counts["ok"] + counts["errors"],
        errors=counts["errors"],
        late=late,
        served={app.name: len(app.arrivals) for app in apps},
        refused=refused,
        wall=time.perf_counter() - t0,
    )


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
    print()
    print(
        f"rolling restart: {ROLLED} instances hosted by nadisc.hosting (hypercorn, ephemeral "
        "ports, registered without ip/port), replaced one by one under load"
    )
    rolling: RollingRun = anyio.run(lambda: run_rolling(concurrency=concurrency), backend="trio")
    result.rolling = rolling
    print(rolling.table())
    if rolling.problems:
        for problem in rolling.problems:
            print(f"FAILED: {problem}")
        raise SystemExit(1)
    print("invariants held: no failed request, nothing reached an instance after it left")
    return result


if __name__ == "__main__":
    import sys

    main(argv=sys.argv[1:])
