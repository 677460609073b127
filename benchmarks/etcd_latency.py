"""Change latency through etcd and the discovery owner: from a ``put`` to
the instance being committed in a streaming balance.

The experiment
    A throw-away etcd runs on loopback (started by this script). A discovery
    owner is opened with ``nadisc.open_discovery`` on a config naming the
    ``etcd`` provider (loaded through its entry point) and observes one
    service; a :class:`nadisc._route.Route` (what the discovery transport
    builds per service) mirrors the observation into a
    :class:`poise.StreamingDiscoveryBalance`. For each of ``N`` changes the
    script puts a new instance record (the gRPC resolver layout) with a
    plain HTTP client, as a registrant in another process would, and
    measures, from just before the put is sent:

    * **observation**: until ``await observation.changed()`` returned and
      the observation's snapshot lists the new instance (watch event,
      decoded, published into the owner's shared slot, evidence rules
      applied, the waiting task woken);
    * **committed**: until the route has synced that snapshot into its
      directory and ``await streaming.ready()`` has reconciled it, with an
      endpoint for the new instance committed in the balance.

    The pool is kept at 10 instances (the oldest is deleted after each
    measured change, and its removal awaited, unmeasured). Five warm-up
    changes are not counted. The target is a median of at most 20 ms on
    loopback.

Run: ``python -m benchmarks.etcd_latency [--smoke] [--changes N]``
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from nadisc import DiscoveryConfig, EvidenceUnavailable, Observation, RestOptions, open_discovery
from nadisc._route import Route

CHANGES = 200
SMOKE_CHANGES = 20
WARMUP = 5
POOL = 10
TARGET_MEDIAN_MS = 20.0


@dataclass(frozen=True)
class Row:
    stage: str
    samples: int
    median_ms: float
    p99_ms: float
    max_ms: float

    @property
    def meets_target(self) -> bool:
        return self.median_ms <= TARGET_MEDIAN_MS


def nearest_rank(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 1))
    return ordered[int(rank) - 1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EtcdProcess:
    """A single-member etcd on loopback with a temporary data dir."""

    def __init__(self, binary: str, root: Path) -> None:
        self.client = f"http://127.0.0.1:{_free_port()}"
        peer = f"http://127.0.0.1:{_free_port()}"
        env = dict(os.environ)
        if platform.machine() in ("aarch64", "arm64"):
            env["ETCD_UNSUPPORTED_ARCH"] = "arm64"
        command = [
            binary,
            "--name", "default",
            "--data-dir", str(root / "data"),
            "--listen-client-urls", self.client,
            "--advertise-client-urls", self.client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            "--heartbeat-interval", "20",
            "--election-timeout", "200",
            "--logger", "zap",
            "--log-outputs", str(root / "etcd.log"),
            "--log-level", "warn",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        until = time.monotonic() + 15
        while time.monotonic() < until:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.process.returncode}")
            try:
                answer = httpx.post(f"{self.client}/v3/maintenance/status", content=b"{}")
                if answer.status_code == 200 and json.loads(answer.content).get("leader"):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("etcd did not become ready within 15 s")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def _config(url: str) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "etcd",
                    "request_timeout_ms": 2000,
                    "etcd": {
                        "endpoints": [url],
                        "prefix": "bench",
                        "probe_interval_ms": 60_000,
                        "services": {"svc": {"name": "svc"}},
                    },
                }
            },
        }
    )


def _listed(observation: Observation, identity: str) -> bool:
    try:
        return identity in observation.snapshot().identities()
    except EvidenceUnavailable:
        return False


def _committed(route: Route) -> set[str]:
    return {str(endpoint.key) for endpoint in route.streaming.discovery.endpoints}


async def _measure(url: str, changes: int) -> list[Row]:
    observed_ms: list[float] = []
    commit_ms: list[float] = []

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:

        async def put(identity: str, n: int) -> None:
            value = json.dumps({"Op": 0, "Addr": f"10.9.{n // 250 % 250}.{n % 250 + 1}:80"})
            key = b64(f"bench/svc/{identity}")
            answer = await http.post(f"{url}/v3/kv/put", json={"key": key, "value": b64(value)})
            answer.raise_for_status()

        await put("seed", 0)
        async with open_discovery(_config(url)) as owner:
            observation = await owner.client().observe("svc", trio.current_time() + 5)
            route = Route(observation, RestOptions())
            try:
                route.snapshot()
                await route.streaming.ready()
                for n in range(changes + WARMUP):
                    identity = f"i{n:05d}"
                    began = time.perf_counter()
                    await put(identity, n + 1)
                    while not _listed(observation, identity):
                        await observation.changed(trio.current_time() + 5)
                    observed = time.perf_counter()
                    while identity not in _committed(route):
                        route.snapshot()
                        await route.streaming.ready()
                    committed = time.perf_counter()
                    if n >= WARMUP:
                        observed_ms.append((observed - began) * 1e3)
                        commit_ms.append((committed - began) * 1e3)
                    gone = "seed" if n == 0 else (f"i{n - POOL:05d}" if n >= POOL else None)
                    if gone is not None:
                        await http.post(
                            f"{url}/v3/kv/deleterange", json={"key": b64(f"bench/svc/{gone}")}
                        )
                        while _listed(observation, gone):
                            await observation.changed(trio.current_time() + 5)
                route.snapshot()
                await route.streaming.ready()
                pool = _committed(route)
            finally:
                route.close()
    if len(pool) != min(POOL, changes + WARMUP):
        raise RuntimeError(f"the pool ended with {len(pool)} members, expected {POOL}")

    def row(stage: str, values: list[float]) -> Row:
        return Row(stage, len(values), nearest_rank(values, 0.5), nearest_rank(values, 0.99),
                   max(values))  # fmt: skip

    return [
        row("put -> observation changed", observed_ms),
        row("put -> streaming balance commit", commit_ms),
    ]


def render(rows: Sequence[Row]) -> str:
    header = f"{'stage':<34} {'n':>5} {'median ms':>10} {'p99 ms':>8} {'max ms':>8}  target"
    lines = [header, "-" * len(header)]
    for r in rows:
        verdict = "ok" if r.meets_target else f"MISSED (median > {TARGET_MEDIAN_MS:g} ms)"
        lines.append(
            f"{r.stage:<34} {r.samples:>5} {r.median_ms:>10.2f} {r.p99_ms:>8.2f} "
            f"{r.max_ms:>8.2f}  {verdict}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_CHANGES} changes")
    parser.add_argument("--changes", type=int, default=None, help=f"default {CHANGES}")
    args = parser.parse_args(argv)
    changes = args.changes or (SMOKE_CHANGES if args.smoke else CHANGES)
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("the etcd binary is not installed (apt-get install etcd-server)")
    with tempfile.TemporaryDirectory(prefix="etcd-latency-") as root:
        server = EtcdProcess(binary, Path(root))
        try:
            rows = trio.run(_measure, server.client, changes)
        finally:
            server.stop()
    print(
        f"etcd change latency through the discovery owner, {changes} changes on loopback "
        "(target median <= 20 ms)"
    )
    print(render(rows))
    return rows


if __name__ == "__main__":
    main()
