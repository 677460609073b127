"""Calling through dead, hung and restarting instances: failed requests and p99.

The experiment
    A registry (a throw-away real etcd on loopback started by this script,
    or the Consul fake of ``tests/fakes/consul.py`` in a process of its own)
    and three instances hosted by ``nadisc.hosting.serve`` in their own
    processes (this file run with ``--host CONFIG``: a plain ASGI app that
    answers ``200 <pid>`` to every method). A caller in this process (its
    own discovery owner watching the registry) sends requests at a fixed
    rate through ``DiscoveryTransport``, each in its own task so a hung one
    does not hold the others back, and records every outcome: a 200 is ok,
    anything else (status or exception) is a failed request. Scenarios:

    * **kill -9**: SIGKILL one of the three; the caller runs on until its
      lease expired (``ttl_seconds`` 15; full size) or a few seconds (smoke).
      Defaults, no retries (``max_attempts: 1``).
    * **SIGSTOP**: one of the three is stopped for 10 s (smoke: 2 s), then
      continued; ``max_attempts: 3``, ``attempt_timeout_ms: 500``.
    * **rolling restart**: 20 rounds (smoke: 2): start a new instance, wait
      until it is registered, SIGTERM the oldest and wait for its exit
      (deregister, grace, drain); GETs and POSTs alternate; defaults, no
      retries; on real etcd and on the Consul fake.

    The caller's connection serves stale evidence for 20 s after a failed
    refresh (``snapshot.stale_if_error_ms``, the production setting), so a
    registry slowed by a busy machine does not count. Every scenario runs
    twice: with the defaults, and with the calling
    layer's new defaults switched off (``rest.outlier.enabled: false``,
    ``retry_on_connect_failure: false``, no attempt timeout, the hosts'
    ``deregister_grace_ms: 0``), which is how calling behaved before them.

``--smoke`` runs the kill -9 scenario with the defaults only, for one
second, and five keep-alive trials.

Run: ``python -m benchmarks.calling_faults [--smoke]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import trio

from benchmarks.etcd_latency import EtcdProcess, nearest_rank
from nadisc import DiscoveryConfig, DiscoveryTransport, open_discovery
from tests.fakes.consul import run_consul_fake
from tests.hosting.support import consul_config, etcd_config, unique_prefix

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")
RATE = 200.0


@dataclass(frozen=True)
class Row:
    scenario: str
    registry: str
    settings: str
    requests: int
    failed: int
    p99_ms: float
    kinds: str


# ------------------------------------------------------------------ the hosted app


async def _app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(os.getpid()).encode()})


async def _host_main(config_path: str, grace_ms: float | None) -> None:
    from nadisc import load_config_file
    from nadisc.hosting import Host, serve

    config = load_config_file(config_path)
    async with trio.open_nursery() as nursery:
        host: Host = await nursery.start(
            lambda task_status: serve(
                _app,
                config,
                allow_loopback=True,
                drain_timeout_ms=3000,
                deregister_grace_ms=grace_ms,
                task_status=task_status,
            )
        )
        print("serving", " ".join(f"{n}={h}:{p}" for n, (h, p) in host.bound.items()), flush=True)


async def _consul_main() -> None:
    async with run_consul_fake() as fake:
        print("serving", fake.url, flush=True)
        await trio.sleep_forever()


class ConsulProcess:
    """The Consul fake in a process of its own (the caller's loop stays the caller's)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.calling_faults", "--consul"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode()
        if not line.startswith("serving "):
            self.close()
            raise RuntimeError(f"the Consul fake did not start: {line!r}")
        self.url = line.split()[1]

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


class Hosted:
    """One hosted instance in its own process (``module`` run with ``--host
    CONFIG`` and ``extra``; it prints ``serving ...`` once started)."""

    def __init__(
        self,
        config_path: Path,
        grace_ms: float | None,
        *,
        module: str = "benchmarks.calling_faults",
        extra: Sequence[str] = (),
    ) -> None:
        command = [sys.executable, "-m", module, "--host", str(config_path), *extra]
        if grace_ms is not None:
            command += ["--grace-ms", str(grace_ms)]
        self.log = config_path.with_suffix(f".{id(self)}.log")
        self._stderr = self.log.open("wb")
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
        )

    async def started(self) -> None:
        assert self.process.stdout is not None
        line = await trio.to_thread.run_sync(self.process.stdout.readline)
        if not line.startswith(b"serving "):
            self.process.kill()
            self.process.wait()
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"a hosted instance did not start: {line!r}\n{tail}")

    def signal(self, number: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(number)

    async def exited(self) -> None:
        await trio.to_thread.run_sync(self.process.wait)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()


# ------------------------------------------------------------------ the caller


def _caller(hosted: DiscoveryConfig, rest: dict[str, Any]) -> DiscoveryConfig:
    document = hosted.model_dump(mode="json")
    document["registrations"] = {}
    document["eligibility_probe"] = False
    document["connections"]["primary"]["rest"] = rest
    # The production evidence setting (docs/calling.md, Registry outages): a
    # registry answering late on a busy machine is not what is measured here.
    document["connections"]["primary"]["snapshot"] = {
        "max_age_ms": 30_000,
        "stale_if_error_ms": 20_000,
    }
    return DiscoveryConfig.model_validate(document)


async def at_rate(one: Callable[[int], Awaitable[None]], stop: trio.Event) -> None:
    """``one(n)`` for n = 1, 2, ... at ``RATE`` a second, each in its own task, until ``stop``."""
    async with trio.open_nursery() as nursery:
        next_at = trio.current_time()
        n = 0
        while not stop.is_set():
            n += 1
            nursery.start_soon(one, n)
            next_at += 1.0 / RATE
            await trio.sleep_until(next_at)


class Load:
    """Requests at a fixed rate, one task each; every outcome recorded."""

    def __init__(self, http: httpx.AsyncClient, post_every: int = 0) -> None:
        self.http = http
        self.post_every = post_every
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.counting = False

    async def one(self, n: int) -> None:
        started = trio.current_time()
        method = "POST" if self.post_every and n % self.post_every == 0 else "GET"
        try:
            answer = await self.http.request(method, f"nadisc://primary/self/r/{n}", content=b"x")
            outcome = None if answer.status_code == 200 else f"status {answer.status_code}"
        except Exception as exc:  # every failure is counted, by kind
            outcome = type(exc).__name__
            reason = getattr(exc, "reason", None)
            if isinstance(reason, str):
                outcome += f" ({reason})"
        if self.counting:
            self.latencies.append(trio.current_time() - started)
            if outcome is not None:
                self.failures.append(outcome)

    async def run(self, stop: trio.Event) -> None:
        await at_rate(self.one, stop)

    def row(self, scenario: str, registry: str, settings: str) -> Row:
        kinds: dict[str, int] = {}
        for kind in self.failures:
            kinds[kind] = kinds.get(kind, 0) + 1
        p99 = nearest_rank(self.latencies, 0.99) * 1000 if self.latencies else 0.0
        return Row(
            scenario,
            registry,
            settings,
            len(self.latencies),
            len(self.failures),
            p99,
            ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "-",
        )


NEW = "defaults"
OLD = "switched off"


def _rest(settings: str, **extra: Any) -> dict[str, Any]:
    rest: dict[str, Any] = {"request_timeout_ms": 10_000, **extra}
    if settings == OLD:
        rest.update({"outlier": {"enabled": False}, "retry_on_connect_failure": False})
        rest.pop("attempt_timeout_ms", None)
    return rest


async def _scenario(
    name: str,
    registry: str,
    settings: str,
    config: DiscoveryConfig,
    root: Path,
    rest: dict[str, Any],
    act: Any,
    post_every: int = 0,
    warm: float = 1.0,
) -> Row:
    path = root / f"host-{name.replace(' ', '-')}-{registry.split()[0]}-{len(settings)}.json"
    path.write_text(json.dumps({"discovery": config.model_dump(mode="json")}))
    grace = 0 if settings == OLD else None
    hosts: list[Hosted] = []

    async def start() -> Hosted:
        hosted = Hosted(path, grace)
        hosts.append(hosted)
        await hosted.started()
        return hosted

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(start)
        async with open_discovery(_caller(config, rest)) as caller:
            transport = DiscoveryTransport(caller)
            async with httpx.AsyncClient(mounts={"nadisc://": transport}, timeout=30) as http:
                load = Load(http, post_every)
                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(load.run, stop)
                    await trio.sleep(warm)  # every instance known and in use
                    load.counting = True
                    await act(hosts, start)
                    stop.set()
                return load.row(name, registry, settings)
    finally:
        for hosted in hosts:
            hosted.close()


def _kill9(after: float) -> Any:
    async def act(hosts: list[Hosted], start: Any) -> None:
        hosts[0].signal(signal.SIGKILL)
        await trio.sleep(after)

    return act


def _sigstop(pause: float) -> Any:
    async def act(hosts: list[Hosted], start: Any) -> None:
        hosts[0].signal(signal.SIGSTOP)
        await trio.sleep(pause)
        hosts[0].signal(signal.SIGCONT)
        await trio.sleep(1.0)

    return act


def _rolling(rounds: int) -> Any:
    async def act(hosts: list[Hosted], start: Any) -> None:
        running = list(hosts)
        for _ in range(rounds):
            await start()
            running.append(hosts[-1])
            await trio.sleep(0.3)  # the new one gets traffic
            old = running.pop(0)
            old.signal(signal.SIGTERM)
            await old.exited()
        await trio.sleep(0.3)

    return act


def _etcd(url: str) -> DiscoveryConfig:
    # A prefix of its own per scenario: a killed instance's record (its lease
    # lives on for the TTL) must not leak into the next scenario.
    document = etcd_config(url, unique_prefix()).model_dump(mode="json")
    document["connections"]["primary"]["etcd"]["ttl_seconds"] = 15  # the setting
    return DiscoveryConfig.model_validate(document)


async def run_all(
    etcd_url: str, root: Path, smoke: bool, only: str | None = None, rounds: int | None = None
) -> list[Row]:
    rows: list[Row] = []
    after = 1.0 if smoke else 14.0
    pause = 1.0 if smoke else 10.0
    rounds = rounds or (1 if smoke else 20)
    warm = 0.5 if smoke else 1.0
    for settings in (NEW,) if smoke else (NEW, OLD):
        plain = _rest(settings)
        patient = _rest(settings, max_attempts=3, attempt_timeout_ms=500)
        scenarios: list[tuple[str, str, Any, dict[str, Any], Any, int]] = [
            ("kill -9", "etcd", _etcd(etcd_url), plain, _kill9(after), 0),
            ("SIGSTOP", "etcd", _etcd(etcd_url), patient, _sigstop(pause), 0),
            ("rolling", "etcd", _etcd(etcd_url), plain, _rolling(rounds), 2),
        ]
        if smoke:
            scenarios = scenarios[:1]  # hosted processes are the cost: one scenario
        for name, registry, config, rest, act, posts in scenarios:
            if only is not None and name != only:
                continue
            rows.append(
                await _scenario(name, registry, settings, config, root, rest, act, posts, warm)
            )
            print(render(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        if smoke or only not in (None, "rolling"):
            continue
        fake = ConsulProcess()
        try:
            consul = consul_config(fake.url, check_path=None)
            rows.append(
                await _scenario(
                    "rolling", "Consul fake", settings, consul, root, plain, _rolling(rounds), 2
                )
            )
        finally:
            fake.close()
    return rows


async def keepalive_race(server_idle: float, client_expiry: float, trials: int) -> int:
    """Failed reuses of an idle pooled connection around the server's idle close.

    One hypercorn server (``keep_alive_timeout=server_idle``) and one httpx
    pool (``keepalive_expiry=client_expiry``); each trial sends a request,
    waits an idle gap swept across ``server_idle`` (from 20 ms before it, 1 ms
    more per trial) and sends again. A gap the pool still trusts but the
    server already acted on fails the second request.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve as serve_hypercorn

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.keep_alive_timeout = server_idle
    config.accesslog = None
    config.errorlog = None
    failed = 0
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: serve_hypercorn(_app, config, task_status=task_status)
        )
        limits = httpx.Limits(keepalive_expiry=client_expiry)
        async with httpx.AsyncClient(limits=limits, trust_env=False) as http:
            for trial in range(trials):
                await http.get(binds[0])
                await trio.sleep(server_idle - 0.02 + trial * 0.001)
                try:
                    await http.get(binds[0])
                except httpx.TransportError:
                    failed += 1
        nursery.cancel_scope.cancel()
    return failed


def render(rows: Sequence[Row]) -> str:
    header = (
        f"{'scenario':<9} {'registry':<12} {'settings':<13} {'requests':>8} {'failed':>7} "
        f"{'p99':>9}  failures"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.scenario:<9} {r.registry:<12} {r.settings:<13} {r.requests:>8} {r.failed:>7} "
            f"{r.p99_ms:>6.0f} ms  {r.kinds}"
        )
    return "\n".join(lines)


def with_etcd(prefix: str, run: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``trio.run(run, etcd_url, root, *args)`` beside a throw-away etcd in a temporary ``root``."""
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("the etcd binary is not installed (apt-get install etcd-server)")
    with tempfile.TemporaryDirectory(prefix=prefix) as root:
        server = EtcdProcess(binary, Path(root))
        try:
            return trio.run(run, server.client, Path(root), *args)
        finally:
            server.stop()


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="short scenarios, 2 rounds")
    parser.add_argument("--only", choices=["kill -9", "SIGSTOP", "rolling"], help="one scenario")
    parser.add_argument("--rounds", type=int, default=None, help="rolling restart rounds (20)")
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--consul", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--grace-ms", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.consul:
        trio.run(_consul_main)
        return []
    if args.host:
        trio.run(_host_main, args.host, args.grace_ms)
        return []
    rows = with_etcd("calling-faults-", run_all, args.smoke, args.only, args.rounds)
    load = os.getloadavg()
    print(
        f"calling through faults at {RATE:g} req/s, 3 hosted instances "
        f"(load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})"
    )
    print(render(rows))
    trials = 5 if args.smoke else 40
    print(f"\nkeep-alive race: idle reuses failed of {trials} (hypercorn server, httpx pool)")
    for server_idle, client_expiry, what in (
        (0.3, 5.0, "server idle close before the pool's expiry"),
        (0.6, 0.3, "server idle close after the pool's expiry (the host's order)"),
    ):
        failed = trio.run(keepalive_race, server_idle, client_expiry, trials)
        print(f"  server {server_idle:.1f} s, pool {client_expiry:.1f} s: {failed:>3}  ({what})")
    return rows


if __name__ == "__main__":
    main()
