"""Hosted gRPC servers restarted one by one, or killed, under load through discovery.

The experiment
    A registry (a throw-away real etcd on loopback started by this script,
    or the Consul fake of ``tests/fakes/consul.py`` in a process of its own)
    and three gRPC servers, each a real host of ours in its own process (this
    file run with ``--host CONFIG``: ``nadisc.hosting.serve`` with one gRPC
    listener on an ephemeral port, grpcio's server, the health service, the
    gRPC protocol metadata on its registration). Each server logs the time
    of every RPC it receives and, at exit, its ``HostReport``: when the
    deregistration was acknowledged, when it stopped, and so on.

    A caller in this process (its own discovery owner watching the
    registry) sends 200 RPCs a second through
    ``nadisc.grpc.discovery_channel``, each in its own task: three unary
    calls, then one server-streaming call of 5 messages 10 ms apart, and so
    on. No retry policy: only the channel's transparent retries (calls the
    server never saw). It records when each RPC was sent, which server
    answered and how it ended, and when its own observation stopped listing
    each server. All times are ``time.perf_counter()`` (CLOCK_MONOTONIC,
    one clock for every process of the machine).

    * **rolling**: 20 rounds (tests: fewer): start a new server, wait until
      the caller lists it, SIGTERM the oldest and wait for its exit (health
      NOT_SERVING and deregister, the ack, the deregistration grace,
      ``server.stop(grace)``, close).
    * **kill -9**: SIGKILL one of the three; the caller runs on for 10 s
      (smoke: 1 s). The dead server's record stays listed until its lease
      expires (etcd ``ttl_seconds`` 15): the channel's ejection and its
      transparent retry of refused connections are what keep calls whole.

Columns: RPCs in the window and how many failed (every failure counts);
``after ack``: RPCs that reached a server after its deregistration was
acknowledged (and the latest of them, in ms after the ack); ``after stop``:
RPCs that reached a server after it began refusing (must be 0); ``sent
after seen``: RPCs the caller sent after its own observation had dropped
that server, and that reached it (must be 0: the channel's guarantee);
then the median shutdown steps of the restarted servers (ack, grace, stop).

Why ``after ack`` is not 0 by construction: the registry answers the host's
delete and sends the watch event to the callers at the same moment; a call
the caller sends before its watch event arrives reaches the server after
the ack. The deregistration grace is there for exactly those calls: the
server keeps serving them, so none fails. The strict claims are the two
columns that must be 0.

``--smoke`` runs one rolling round against etcd.

Run: ``python -m benchmarks.grpc_rolling [--smoke] [--rounds N]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import trio

from benchmarks.calling_faults import RATE, ConsulProcess, Hosted, _caller, at_rate, with_etcd
from benchmarks.etcd_latency import nearest_rank
from nadisc import DiscoveryConfig, open_discovery
from tests.hosting.support import consul_config, etcd_config, unique_prefix

SERVICE = "bench.Roll"
UNARY = f"/{SERVICE}/Unary"
STREAM = f"/{SERVICE}/Stream"
STREAM_EVERY = 4
STREAM_MESSAGES = 5
STREAM_GAP = 0.01


# ------------------------------------------------------------------ the hosted server


def _handlers(arrivals: list[float], name: bytes) -> Any:
    import grpc

    def unary(request: bytes, context: Any) -> bytes:
        arrivals.append(time.perf_counter())
        return name

    def stream(request: bytes, context: Any) -> Iterator[bytes]:
        arrivals.append(time.perf_counter())
        for _ in range(STREAM_MESSAGES):
            time.sleep(STREAM_GAP)
            yield name

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        },
    )


async def _host_main(config_path: str, log_path: str) -> None:
    from nadisc import load_config_file
    from nadisc.hosting import Bind, GrpcServe, Host, serve

    config = load_config_file(config_path)
    arrivals: list[float] = []
    # The loop clock (trio's has an offset) read against perf_counter once.
    offset = anyio.current_time() - time.perf_counter()
    serving = GrpcServe(handlers=[_handlers(arrivals, str(os.getpid()).encode())])
    listeners = {"grpc": Bind("127.0.0.1", 0, grpc=serving)}
    async with anyio.create_task_group() as tg:
        host: Host = await tg.start(
            lambda task_status: serve(
                None,
                config,
                listeners=listeners,
                allow_loopback=True,
                drain_timeout_ms=3000,
                task_status=task_status,
            )
        )
        print("serving", " ".join(f"{n}={h}:{p}" for n, (h, p) in host.bound.items()), flush=True)
    report = host.report
    assert report is not None
    steps = report.grpc["grpc"]

    def perf(moment: float | None) -> float | None:
        return None if moment is None else moment - offset

    _write(
        log_path,
        {
            "pid": os.getpid(),
            "port": host.bound["grpc"][1],
            "arrivals": arrivals,
            "not_serving": perf(steps.not_serving_at),
            "ack": perf(report.deregistered_at),
            "refusing": perf(report.refusing_at),
            "stop": perf(steps.stop_at),
            "stopped": perf(steps.stopped_at),
            "ended": perf(report.started_at + report.total_seconds),
            "abandoned": steps.abandoned,
            "over_budget": report.over_budget,
        },
    )


def _write(path: str, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(result))


# ------------------------------------------------------------------ the caller


@dataclass
class Sent:
    sent: float
    server: str | None
    failure: str | None
    latency: float


class Load:
    """RPCs at a fixed rate through a discovery channel, one task each."""

    def __init__(self, channel: Any) -> None:
        self.unary = channel.unary_unary(UNARY)
        self.stream = channel.unary_stream(STREAM)
        self.records: list[Sent] = []
        self.counting = False

    async def one(self, n: int) -> None:
        from nadisc.grpc import RpcError

        sent = time.perf_counter()
        server: str | None = None
        failure: str | None = None
        try:
            if n % STREAM_EVERY == 0:
                names = [message async for message in self.stream(b"", timeout=10)]
                if len(names) != STREAM_MESSAGES:
                    failure = f"stream of {len(names)}"
                server = names[0].decode() if names else None
            else:
                server = (await self.unary(b"", timeout=10)).decode()
        except RpcError as exc:
            failure = exc.code().name
        except Exception as exc:  # every failure is counted, by kind
            failure = type(exc).__name__
        if self.counting:
            self.records.append(Sent(sent, server, failure, time.perf_counter() - sent))

    async def run(self, stop: trio.Event) -> None:
        await at_rate(self.one, stop)


class Listing:
    """The ports the caller's observation lists, and when each left it."""

    def __init__(self, observation: Any) -> None:
        self.observation = observation
        self.gone: dict[int, float] = {}
        self.ports: set[int] = self._ports()
        self._changed = trio.Event()

    def _ports(self) -> set[int]:
        from nadisc import EvidenceUnavailable

        try:
            return {i.port for i in self.observation.snapshot().instances}
        except EvidenceUnavailable:
            return set()

    async def follow(self) -> None:
        while True:
            await self.observation.changed()
            now = time.perf_counter()
            current = self._ports()
            for port in self.ports - current:
                self.gone.setdefault(port, now)
            self.ports = current
            self._changed.set()
            self._changed = trio.Event()

    async def wait_listed(self, count: int) -> None:
        with trio.fail_after(20):
            while len(self.ports) < count:
                await self._changed.wait()


@dataclass(frozen=True)
class Row:
    scenario: str
    registry: str
    hosts: str
    rounds: int
    rpcs: int
    failed: int
    kinds: str
    after_ack: int
    after_ack_ms: float
    after_stop: int
    sent_after_seen: int
    p99_ms: float
    steps_ms: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0))
    #: The 1-minute load average when the scenario ended.
    load: float = 0.0

    @property
    def failed_share(self) -> float:
        return self.failed / self.rpcs if self.rpcs else 0.0


def _judge(
    name: str,
    registry: str,
    backend: str,
    rounds: int,
    load: Load,
    listing: Listing,
    logs: list[Any],
) -> Row:
    kinds: dict[str, int] = {}
    for record in load.records:
        if record.failure is not None:
            kinds[record.failure] = kinds.get(record.failure, 0) + 1
    after_ack = after_stop = sent_after_seen = 0
    latest = 0.0
    acks, graces, stops = [], [], []
    for log in logs:
        ack, refusing, stop = log["ack"], log["refusing"], log["stop"]
        late = [at - ack for at in log["arrivals"] if at > ack]
        after_ack += len(late)
        latest = max([latest, *late])
        after_stop += sum(1 for at in log["arrivals"] if at > stop)
        acks.append(ack - log["not_serving"])
        graces.append(refusing - ack)
        stops.append(log["stopped"] - stop)
        seen = listing.gone.get(log["port"])
        if seen is not None:
            pid = str(log["pid"])
            sent_after_seen += sum(1 for r in load.records if r.server == pid and r.sent > seen)
    latencies = [r.latency for r in load.records]
    return Row(
        name,
        registry,
        backend,
        rounds,
        len(load.records),
        sum(kinds.values()),
        ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "-",
        after_ack,
        latest * 1000,
        after_stop,
        sent_after_seen,
        nearest_rank(latencies, 0.99) * 1000 if latencies else 0.0,
        tuple(statistics.median(v) * 1000 if v else 0.0 for v in (acks, graces, stops)),  # type: ignore[arg-type]
        os.getloadavg()[0],
    )


async def scenario(
    name: str,
    registry: str,
    config: DiscoveryConfig,
    root: Path,
    *,
    rounds: int = 0,
    after: float = 10.0,
    backend: str = "trio",
    warm: float = 0.5,
) -> Row:
    """One scenario (``rolling`` or ``kill -9``) with 3 hosted servers; its row."""
    from nadisc.grpc import discovery_channel

    tag = f"{name.replace(' ', '')}-{registry.split()[0]}-{backend}"
    path = root / f"grpc-host-{tag}.json"
    path.write_text(json.dumps({"discovery": config.model_dump(mode="json")}))
    hosts: list[Hosted] = []
    logs: dict[int, Path] = {}

    async def start() -> Hosted:
        log = root / f"grpc-host-{tag}-{len(hosts)}.result.json"
        hosted = Hosted(
            path,
            None,
            module="benchmarks.grpc_rolling",
            extra=["--log", str(log), "--backend", backend],
        )
        logs[id(hosted)] = log
        hosts.append(hosted)
        await hosted.started()
        return hosted

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(start)
        async with (
            open_discovery(_caller(config, {})) as caller,
            discovery_channel(caller, "primary", "self") as channel,
        ):
            listing = Listing(await caller.client("primary").observe("self"))
            load = Load(channel)
            stop = trio.Event()
            restarted: list[Hosted] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(listing.follow)
                await listing.wait_listed(3)
                nursery.start_soon(load.run, stop)
                await trio.sleep(warm)  # every server known and in use
                load.counting = True
                if name == "kill -9":
                    hosts[0].signal(signal.SIGKILL)
                    await trio.sleep(after)
                else:
                    running = list(hosts)
                    for _ in range(rounds):
                        await start()
                        running.append(hosts[-1])
                        await listing.wait_listed(4)
                        await trio.sleep(0.2)  # the new one gets traffic
                        old = running.pop(0)
                        old.signal(signal.SIGTERM)
                        await old.exited()
                        restarted.append(old)
                    await trio.sleep(0.2)
                stop.set()
                load.counting = False
                nursery.cancel_scope.cancel()
        results = [json.loads(logs[id(h)].read_text()) for h in restarted]
        return _judge(name, registry, backend, rounds, load, listing, results)
    finally:
        # The servers still running are killed: their records live in a
        # prefix (etcd) or a registry process (Consul fake) of this scenario.
        for hosted in hosts:
            hosted.close()


def etcd(url: str) -> DiscoveryConfig:
    """The host config on etcd: a prefix of its own (a killed server's record
    lives on for its lease), ``ttl_seconds`` 15, the registration on ``grpc``."""
    document = etcd_config(url, unique_prefix(), registration={"listener_ref": "grpc"})
    raw = document.model_dump(mode="json")
    raw["connections"]["primary"]["etcd"]["ttl_seconds"] = 15
    return DiscoveryConfig.model_validate(raw)


def consul(url: str) -> DiscoveryConfig:
    """The host config on the Consul fake (no HTTP check: the listener is gRPC)."""
    return consul_config(url, registration={"listener_ref": "grpc"}, check_path=None)


async def run_all(etcd_url: str, root: Path, smoke: bool, rounds: int) -> list[Row]:
    rows: list[Row] = []

    async def add(*args: Any, **kwargs: Any) -> None:
        rows.append(await scenario(*args, **kwargs))
        print(render(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)

    if smoke:
        await add("rolling", "etcd", etcd(etcd_url), root, rounds=1)
        return rows
    for backend in ("trio", "asyncio"):
        await add("rolling", "etcd", etcd(etcd_url), root, rounds=rounds, backend=backend)
    fake = ConsulProcess()
    try:
        await add("rolling", "Consul fake", consul(fake.url), root, rounds=rounds)
    finally:
        fake.close()
    await add("kill -9", "etcd", etcd(etcd_url), root, after=10.0)
    return rows


def render(rows: Sequence[Row]) -> str:
    header = (
        f"{'scenario':<8} {'registry':<11} {'hosts':<7} {'rounds':>6} {'RPCs':>6} {'failed':>6} "
        f"{'after ack':>14} {'after stop':>10} {'sent after seen':>15} {'p99':>7}  "
        f"{'ack/grace/stop (median ms)':<27} {'load':>5}  failures"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        late = f"{r.after_ack} ({r.after_ack_ms:.0f} ms)"
        steps = "/".join(f"{v:.0f}" for v in r.steps_ms) if r.rounds else "-"
        lines.append(
            f"{r.scenario:<8} {r.registry:<11} {r.hosts:<7} {r.rounds:>6} {r.rpcs:>6} "
            f"{r.failed:>6} {late:>14} {r.after_stop:>10} {r.sent_after_seen:>15} "
            f"{r.p99_ms:>4.0f} ms  {steps:<27} {r.load:>5.1f}  {r.kinds}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="one rolling round on etcd")
    parser.add_argument("--rounds", type=int, default=20, help="rolling restart rounds (20)")
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="trio", help=argparse.SUPPRESS)
    parser.add_argument("--grace-ms", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.host:
        anyio.run(_host_main, args.host, args.log, backend=args.backend)
        return []
    rows = with_etcd("grpc-rolling-", run_all, args.smoke, args.rounds)
    load = os.getloadavg()
    print(
        f"hosted gRPC servers under {RATE:g} RPC/s through the discovery channel "
        f"(1 in {STREAM_EVERY} server-streaming), 3 servers, no retry policy "
        f"(load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})"
    )
    print(render(rows))
    for row in rows:
        if row.scenario == "kill -9":
            print(f"kill -9: {row.failed} of {row.rpcs} RPCs failed ({row.failed_share:.2%})")
    return rows


if __name__ == "__main__":
    main()
