"""The etcd provider against a real etcd client library on the same etcd.

The peer is ``aetcd`` (an asyncio gRPC client of the etcd v3 API, from
PyPI); we talk to the same server through its JSON gateway. Both run on
asyncio in this process (``aetcd`` has no trio support; our side runs
through anyio's asyncio backend), against one throw-away etcd on loopback
started by this script. Rounds interleave the two, so load from elsewhere
on the machine hits both alike; the table shows the medians over rounds.

* **put -> observed**: a writer (a plain HTTP client, the same for both)
  puts a new instance record under a watched service; measured from just
  before the put until the new key is seen: for us, ``observation.changed()``
  returned and the snapshot lists it (watch event decoded, published,
  evidence applied, waiter woken); for the peer, its ``watch_prefix``
  iterator yielded the put event. The process CPU per change (writer
  included, alike for both) is shown too.
* **N-key range**: a service of N records (10,000; 500 with ``--smoke``):
  for us, ``EtcdProvider.query`` (a complete, typed ``ProviderSnapshot``,
  every record validated and decoded); for the peer, ``get_prefix`` with
  every key and value read off its results (the least a user of it does).
  Wall time and process CPU (gRPC's own threads included).

Targets (from the issue): put -> observed p50 <= 1.0x the peer, p99 <= 2x;
range wall <= 1.0x and CPU <= 1.0x. Numbers are what this machine gave,
printed with the load average (the machine may be shared).

Run: ``python -m benchmarks.etcd_peer [--smoke]``
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aetcd  # type: ignore[import-untyped]
import anyio
import httpx
from nadisc_etcd import EtcdProvider, EtcdSettings

from benchmarks.etcd_latency import EtcdProcess, nearest_rank
from nadisc import (
    ConnectionContext,
    DiscoveryConfig,
    EvidenceUnavailable,
    Observation,
    open_discovery,
)


@dataclass(frozen=True)
class Sizes:
    rounds: int
    changes: int
    keys: int


FULL = Sizes(rounds=5, changes=40, keys=10_000)
SMOKE = Sizes(rounds=1, changes=5, keys=500)


@dataclass(frozen=True)
class Row:
    measure: str
    ours: float
    peer: float
    unit: str
    target: float

    @property
    def ratio(self) -> float:
        return self.ours / self.peer if self.peer > 0 else float("inf")

    @property
    def ok(self) -> bool:
        return self.ratio <= self.target


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def record(n: int) -> str:
    return json.dumps({"Op": 0, "Addr": f"10.{n // 62500 % 250}.{n // 250 % 250}.{n % 250 + 1}:80"})


def _listed(observation: Observation, identity: str) -> bool:
    try:
        return identity in observation.snapshot().identities()
    except EvidenceUnavailable:
        return False


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
                        "prefix": "peer",
                        "services": {"svc": {"name": "svc"}},
                    },
                }
            },
        }
    )


class Writer:
    """Puts records through the gateway, as a registrant elsewhere would."""

    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url
        self.http = http
        self.count = 0

    async def put(self, key: str, value: str) -> None:
        answer = await self.http.post(
            f"{self.url}/v3/kv/put", json={"key": b64(key), "value": b64(value)}
        )
        answer.raise_for_status()

    def next_key(self) -> tuple[str, str]:
        self.count += 1
        return f"i{self.count:06d}", record(self.count)


async def ours_changes(url: str, writer: Writer, changes: int) -> tuple[list[float], float]:
    seen: list[float] = []
    async with open_discovery(_config(url)) as owner:
        observation = await owner.client().observe("svc", anyio.current_time() + 10)
        cpu = time.process_time()
        for _ in range(changes):
            identity, value = writer.next_key()
            began = time.perf_counter()
            await writer.put(f"peer/svc/{identity}", value)
            while not _listed(observation, identity):
                await observation.changed(anyio.current_time() + 5)
            seen.append((time.perf_counter() - began) * 1e3)
        spent = time.process_time() - cpu
    return seen, spent / changes


async def peer_changes(
    client: aetcd.Client, writer: Writer, changes: int
) -> tuple[list[float], float]:
    seen: list[float] = []
    watch = await client.watch_prefix(b"peer/svc/")
    events = watch.__aiter__()
    cpu = time.process_time()
    for _ in range(changes):
        identity, value = writer.next_key()
        key = f"peer/svc/{identity}".encode()
        began = time.perf_counter()
        await writer.put(key.decode(), value)
        while True:
            event = await events.__anext__()
            if event.kv.key == key:
                break
        seen.append((time.perf_counter() - began) * 1e3)
    spent = time.process_time() - cpu
    await watch.cancel()
    return seen, spent / changes


def provider_for(url: str, keys: int) -> EtcdProvider:
    context = ConnectionContext(
        name="peer",
        request_timeout=30.0,
        max_instances_per_service=keys + 16,
        max_response_bytes=64 * 2**20,
    )
    settings = EtcdSettings.model_validate({"endpoints": [url], "prefix": "peer"})
    return EtcdProvider(context, settings)


async def ours_range(provider: EtcdProvider, keys: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    snapshot = await provider.query("big", anyio.current_time() + 30)
    spent = time.perf_counter() - wall, time.process_time() - cpu
    assert len(snapshot.instances) == keys, len(snapshot.instances)
    return spent


async def peer_range(client: aetcd.Client, keys: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = await client.get_prefix(b"peer/big/")
    pairs = [(kv.key, kv.value) for kv in result]
    spent = time.perf_counter() - wall, time.process_time() - cpu
    assert len(pairs) == keys, len(pairs)
    return spent


async def measure(url: str, port: int, sizes: Sizes) -> list[Row]:
    ours_seen: list[float] = []
    peer_seen: list[float] = []
    ours_cpu: list[float] = []
    peer_cpu: list[float] = []
    ours_wall_range: list[float] = []
    peer_wall_range: list[float] = []
    ours_cpu_range: list[float] = []
    peer_cpu_range: list[float] = []
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        writer = Writer(url, http)
        await writer.put("peer/svc/seed", record(0))
        limiter = anyio.CapacityLimiter(32)

        async def put_big(n: int) -> None:
            async with limiter:
                await writer.put(f"peer/big/k{n:06d}", record(n))

        async with anyio.create_task_group() as group:
            for n in range(sizes.keys):
                group.start_soon(put_big, n)
        client = aetcd.Client(host="127.0.0.1", port=port)
        await client.connect()
        provider = provider_for(url, sizes.keys)
        try:
            # Warm-up (unmeasured): connections, first decode of each side.
            await ours_range(provider, sizes.keys)
            await peer_range(client, sizes.keys)
            for round_ in range(sizes.rounds):
                # Alternate who goes first in each round.
                sides = ("ours", "peer") if round_ % 2 == 0 else ("peer", "ours")
                for side in sides:
                    if side == "ours":
                        seen, cpu = await ours_changes(url, writer, sizes.changes)
                        ours_seen += seen
                        ours_cpu.append(cpu)
                        wall, spent = await ours_range(provider, sizes.keys)
                        ours_wall_range.append(wall)
                        ours_cpu_range.append(spent)
                    else:
                        seen, cpu = await peer_changes(client, writer, sizes.changes)
                        peer_seen += seen
                        peer_cpu.append(cpu)
                        wall, spent = await peer_range(client, sizes.keys)
                        peer_wall_range.append(wall)
                        peer_cpu_range.append(spent)
        finally:
            await provider.aclose()
            await client.close()
    median = statistics.median
    return [
        Row("put -> observed p50", median(ours_seen), median(peer_seen), "ms", 1.0),
        Row(
            "put -> observed p99",
            nearest_rank(ours_seen, 0.99),
            nearest_rank(peer_seen, 0.99),
            "ms",
            2.0,
        ),
        Row("CPU per change", median(ours_cpu) * 1e3, median(peer_cpu) * 1e3, "ms", 1.0),
        Row(
            f"{sizes.keys:,}-key range wall",
            median(ours_wall_range) * 1e3,
            median(peer_wall_range) * 1e3,
            "ms",
            1.0,
        ),
        Row(
            f"{sizes.keys:,}-key range CPU",
            median(ours_cpu_range) * 1e3,
            median(peer_cpu_range) * 1e3,
            "ms",
            1.0,
        ),
    ]


def render(rows: Sequence[Row]) -> str:
    header = f"{'measure':<26} {'ours':>10} {'aetcd':>10} {'ratio':>7}  target"
    lines = [header, "-" * len(header)]
    for r in rows:
        verdict = "ok" if r.ok else "MISSED"
        lines.append(
            f"{r.measure:<26} {r.ours:>8.2f}{r.unit} {r.peer:>8.2f}{r.unit} {r.ratio:>6.2f}x"
            f"  <= {r.target:g}x {verdict}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="small sizes, one round")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("the etcd binary is not installed (apt-get install etcd-server)")
    with tempfile.TemporaryDirectory(prefix="etcd-peer-") as root:
        server = EtcdProcess(binary, Path(root))
        try:
            port = int(server.client.rsplit(":", 1)[1])
            rows = anyio.run(measure, server.client, port, sizes, backend="asyncio")
        finally:
            server.stop()
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(
        f"etcd provider vs aetcd on one etcd (loopback, asyncio), {sizes.rounds} interleaved "
        f"round(s) of {sizes.changes} changes and one {sizes.keys:,}-key range; "
        f"load average {load}"
    )
    print(render(rows))
    return rows


if __name__ == "__main__":
    main()
