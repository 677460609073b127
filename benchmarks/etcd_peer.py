"""The etcd provider against a real etcd client library on the same etcd.

The peer is ``aetcd`` (an asyncio gRPC client of the etcd v3 API, from
PyPI); we talk to the same server on both of our wires: ``json`` (the v3
JSON gateway over httpx) and ``grpc`` (the v3 gRPC API over
``nadisc.grpc``). All run on asyncio in this process (``aetcd`` has no trio
support; our side runs through anyio's asyncio backend), against one
throw-away etcd on loopback started by this script. Rounds interleave the
three (who goes first rotates), so load from elsewhere on the machine hits
all alike; the table shows the medians over rounds. A ratio of a row
measured once per round (CPU per change, the ranges) is the median of each
round's ratio; a latency percentile is over every round's samples, and its
ratio is of the two percentiles.

* **put -> observed**: a writer in a process of its own (a registrant
  elsewhere: ``benchmarks._etcd_writer``, a plain HTTP client, the same for
  every side) puts a new instance record under a watched service;
  measured from just before the put (the writer's stamp: on Linux
  ``perf_counter`` is ``CLOCK_MONOTONIC``, one clock for all processes)
  until the new key is seen here: for us, ``observation.changed()``
  returned and the snapshot lists it (watch event decoded, published,
  evidence applied, waiter woken); for the peer, its ``watch_prefix``
  iterator yielded the put event. The CPU per change is this process's
  (the watch path alone: our loop, or the peer's loop and gRPC threads).
  Where a tail comes from is split in two rows without a target: ``put
  acked`` (the writer's put answered: etcd's commit and fsync, the same
  for every side) and ``acked -> observed`` (from that answer until the
  change was seen here; below zero when the watch saw it first). One
  more row without a target puts the writer on this process's own loop
  (an ``httpx`` client awaited before the watch is read): a process that
  writes and watches at once, where the writer's answer and the watch
  event wait for each other on one loop while the peer decodes its
  events on gRPC's own threads.
* **N-key range**: a service of N records (10,000; 500 with ``--smoke``):
  for us, ``EtcdProvider.query`` (a complete, typed ``ProviderSnapshot``,
  every record validated and decoded); for the peer, ``get_prefix`` with
  every key and value read off its results (the least a user of it does).
  Wall time and process CPU (gRPC's own threads included). Where it goes
  is shown in two rows without a target: the same range on our wire alone
  (``client.range``: the request and every key-value turned into the wire
  struct, no record decoded; the peer's column is its ``get_prefix`` again).
  Two more rows without a target set the same listing of ours against a
  peer that also parses every value with ``json.loads`` (the least a user
  of a plain client does to get the addresses out of the records; still no
  validation, no typed instance).

Targets (from the issue, judged on the grpc wire; the json column is shown
beside it): put -> observed p50 <= 1.0x the peer, p99 <= 2x, CPU per
change <= 1.0x; range wall
<= 1.0x and CPU <= 1.0x. Numbers are what this machine gave,
printed with the load average (the machine may be shared).

Run: ``python -m benchmarks.etcd_peer [--smoke] [--rounds R]``
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
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


FULL = Sizes(rounds=5, changes=100, keys=10_000)
SMOKE = Sizes(rounds=1, changes=5, keys=500)


@dataclass(frozen=True)
class Row:
    measure: str
    #: Our provider on the JSON gateway wire.
    json: float
    #: Our provider on the gRPC wire (the ratio the targets apply to).
    grpc: float
    peer: float
    unit: str
    target: float
    #: Shown instead of a verdict for a row without a target.
    note: str = "(where it goes)"
    #: (json, grpc) over the peer as the median of each round's ratio, for a
    #: row measured once per round; None for a percentile over all rounds'
    #: samples (then the ratio is of the two percentiles).
    round_ratios: tuple[float, float] | None = None

    @property
    def ours(self) -> float:
        return self.grpc

    @property
    def ratio(self) -> float:
        if self.round_ratios is not None:
            return self.round_ratios[1]
        return self.grpc / self.peer if self.peer > 0 else float("inf")

    @property
    def json_ratio(self) -> float:
        if self.round_ratios is not None:
            return self.round_ratios[0]
        return self.json / self.peer if self.peer > 0 else float("inf")

    @property
    def ok(self) -> bool:
        return self.ratio <= self.target


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def record(n: int) -> str:
    return json.dumps({"Op": 0, "Addr": f"10.{n // 62500 % 250}.{n // 250 % 250}.{n % 250 + 1}:80"})


#: One sequence of new keys for both writers: every new key is the largest yet.
_CHANGES = itertools.count(1)


def next_change() -> tuple[str, str]:
    """The next new instance: its id (the largest key so far) and its record."""
    n = next(_CHANGES)
    return f"i{n:06d}", record(n)


def _listed(observation: Observation, identity: str) -> bool:
    # Whether the snapshot lists ``identity``. The records are listed in key
    # order and every new key is the largest yet (``next_change``), so the
    # new one is listed last: one comparison, as the peer compares one
    # event's key (a search of the listing would cost O(listed) per look,
    # and the first look comes before the change arrived).
    try:
        instances = observation.snapshot().instances
    except EvidenceUnavailable:
        return False
    return bool(instances) and instances[-1].identity == identity


def _config(url: str, wire: str) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            # Every round adds 600 instances to the watched service (100 a
            # side, twice): room for many more rounds than the default.
            "limits": {"max_instances_per_service": 65_536},
            "connections": {
                "primary": {
                    "provider": "etcd",
                    "request_timeout_ms": 2000,
                    "etcd": {
                        "endpoints": [url],
                        "prefix": "peer",
                        "services": {"svc": {"name": "svc"}},
                        "wire": wire,
                    },
                }
            },
        }
    )


class Writer:
    """Puts records through the gateway from this process's own loop (the
    range's records, and the one-loop row of put -> observed)."""

    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url
        self.http = http

    async def put(self, key: str, value: str) -> None:
        answer = await self.http.post(
            f"{self.url}/v3/kv/put", json={"key": b64(key), "value": b64(value)}
        )
        answer.raise_for_status()


class RemoteWriter:
    """The writer in a process of its own (``benchmarks._etcd_writer``),
    commanded through a pipe and answering through another, neither of them
    watched by the event loop: a command is one small write, and the answer
    is read (blocking) only once the change was seen."""

    def __init__(self, url: str) -> None:
        self._commands_in, self._commands = os.pipe()
        self._replies, self._replies_out = os.pipe()
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks._etcd_writer",
                url,
                str(self._commands_in),
                str(self._replies_out),
            ],
            pass_fds=(self._commands_in, self._replies_out),
            cwd=Path(__file__).resolve().parent.parent,
        )
        os.close(self._commands_in)
        os.close(self._replies_out)
        self._pending = b""

    def send(self, key: str, value: str) -> float:
        """Ask for the put; returns the time just before the command was written."""
        line = f"{key} {value}\n".encode()
        sent = time.perf_counter()
        os.write(self._commands, line)
        return sent

    def answer(self) -> tuple[float, float]:
        """The writer's stamps of the last put: (before it, its answer read)."""
        while b"\n" not in self._pending:
            chunk = os.read(self._replies, 4096)
            if not chunk:
                raise RuntimeError(f"the writer exited ({self._process.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        began, done = map(float, line.split())
        return began, done

    def close(self) -> None:
        os.close(self._commands)  # the writer ends at the end of its commands
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        finally:
            os.close(self._replies)


def _stamps(sent: float, began: float, done: float, seen: float) -> tuple[float, float]:
    """(put -> observed, put acked) in ms from the writer's and our stamps,
    checked to be on one clock: the writer began after our command and
    before we saw its change."""
    if not sent <= began <= seen:
        raise RuntimeError("the writer's clock is not this process's (perf_counter)")
    return (seen - began) * 1e3, (done - began) * 1e3


async def ours_changes(
    url: str, writer: RemoteWriter, changes: int, wire: str
) -> tuple[list[float], list[float], float]:
    seen: list[float] = []
    acks: list[float] = []
    async with open_discovery(_config(url, wire)) as owner:
        observation = await owner.client().observe("svc", anyio.current_time() + 10)
        cpu = time.process_time()
        for _ in range(changes):
            identity, value = next_change()
            sent = writer.send(f"peer/svc/{identity}", value)
            while not _listed(observation, identity):
                await observation.changed(anyio.current_time() + 5)
            at = time.perf_counter()
            latency, acked = _stamps(sent, *writer.answer(), at)
            seen.append(latency)
            acks.append(acked)
        spent = time.process_time() - cpu
    return seen, acks, spent / changes


async def peer_changes(
    client: aetcd.Client, writer: RemoteWriter, changes: int
) -> tuple[list[float], list[float], float]:
    seen: list[float] = []
    acks: list[float] = []
    watch = await client.watch_prefix(b"peer/svc/")
    events = watch.__aiter__()
    cpu = time.process_time()
    for _ in range(changes):
        identity, value = next_change()
        key = f"peer/svc/{identity}".encode()
        sent = writer.send(key.decode(), value)
        while True:
            event = await events.__anext__()
            if event.kv.key == key:
                break
        at = time.perf_counter()
        latency, acked = _stamps(sent, *writer.answer(), at)
        seen.append(latency)
        acks.append(acked)
    spent = time.process_time() - cpu
    await watch.cancel()
    return seen, acks, spent / changes


async def ours_changes_local(url: str, writer: Writer, changes: int, wire: str) -> list[float]:
    """put -> observed with the writer on this loop (awaited, then the watch)."""
    seen: list[float] = []
    async with open_discovery(_config(url, wire)) as owner:
        observation = await owner.client().observe("svc", anyio.current_time() + 10)
        for _ in range(changes):
            identity, value = next_change()
            began = time.perf_counter()
            await writer.put(f"peer/svc/{identity}", value)
            while not _listed(observation, identity):
                await observation.changed(anyio.current_time() + 5)
            seen.append((time.perf_counter() - began) * 1e3)
    return seen


async def peer_changes_local(client: aetcd.Client, writer: Writer, changes: int) -> list[float]:
    seen: list[float] = []
    watch = await client.watch_prefix(b"peer/svc/")
    events = watch.__aiter__()
    for _ in range(changes):
        identity, value = next_change()
        key = f"peer/svc/{identity}".encode()
        began = time.perf_counter()
        await writer.put(key.decode(), value)
        while True:
            event = await events.__anext__()
            if event.kv.key == key:
                break
        seen.append((time.perf_counter() - began) * 1e3)
    await watch.cancel()
    return seen


def provider_for(url: str, keys: int, wire: str) -> EtcdProvider:
    context = ConnectionContext(
        name="peer",
        request_timeout=30.0,
        max_instances_per_service=keys + 16,
        max_response_bytes=64 * 2**20,
    )
    settings = EtcdSettings.model_validate({"endpoints": [url], "prefix": "peer", "wire": wire})
    return EtcdProvider(context, settings)


async def ours_range(provider: EtcdProvider, keys: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    snapshot = await provider.query("big", anyio.current_time() + 30)
    spent = time.perf_counter() - wall, time.process_time() - cpu
    assert len(snapshot.instances) == keys, len(snapshot.instances)
    return spent


async def wire_range(provider: EtcdProvider, keys: int) -> tuple[float, float]:
    """The same range on our wire alone: the request and every key-value
    turned into the wire struct, no record decoded (where the rest goes)."""
    client = provider._client
    cpu, wall = time.process_time(), time.perf_counter()
    answer = await client.range(
        b"peer/big/", b"peer/big0", limit=keys + 1, deadline=anyio.current_time() + 30
    )
    spent = time.perf_counter() - wall, time.process_time() - cpu
    assert len(answer.kvs) == keys, len(answer.kvs)
    return spent


async def peer_range(client: aetcd.Client, keys: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = await client.get_prefix(b"peer/big/")
    pairs = [(kv.key, kv.value) for kv in result]
    spent = time.perf_counter() - wall, time.process_time() - cpu
    assert len(pairs) == keys, len(pairs)
    return spent


async def peer_range_decoded(client: aetcd.Client, keys: int) -> tuple[float, float]:
    """The peer's ``get_prefix`` with every value parsed by ``json.loads``."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = await client.get_prefix(b"peer/big/")
    records = [(kv.key, json.loads(kv.value)) for kv in result]
    spent = time.perf_counter() - wall, time.process_time() - cpu
    assert len(records) == keys, len(records)
    return spent


SIDES = ("json", "grpc", "aetcd")


async def measure(url: str, port: int, sizes: Sizes) -> list[Row]:
    seen: dict[str, list[float]] = {side: [] for side in SIDES}
    #: When the writer's put was answered (etcd's own commit, fsync included).
    acks: dict[str, list[float]] = {side: [] for side in SIDES}
    #: put -> observed with the writer on this process's loop.
    seen_local: dict[str, list[float]] = {side: [] for side in SIDES}
    cpu: dict[str, list[float]] = {side: [] for side in SIDES}
    wall_range: dict[str, list[float]] = {side: [] for side in SIDES}
    cpu_range: dict[str, list[float]] = {side: [] for side in SIDES}
    #: The range on our wire alone (the peer's column: its get_prefix again).
    wall_wire: dict[str, list[float]] = {side: [] for side in SIDES}
    cpu_wire: dict[str, list[float]] = {side: [] for side in SIDES}
    #: The peer's range with every value parsed as JSON (ours: the range again).
    wall_parsed: dict[str, list[float]] = {side: [] for side in SIDES}
    cpu_parsed: dict[str, list[float]] = {side: [] for side in SIDES}
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        writer = Writer(url, http)
        await writer.put("peer/svc/a-seed", record(0))
        limiter = anyio.CapacityLimiter(32)

        async def put_big(n: int) -> None:
            async with limiter:
                await writer.put(f"peer/big/k{n:06d}", record(n))

        async with anyio.create_task_group() as group:
            for n in range(sizes.keys):
                group.start_soon(put_big, n)
        client = aetcd.Client(host="127.0.0.1", port=port)
        await client.connect()
        providers = {wire: provider_for(url, sizes.keys, wire) for wire in ("json", "grpc")}
        remote = RemoteWriter(url)
        try:
            # Warm-up (unmeasured): connections, first decode of each side,
            # the writer process's first put.
            remote.send("peer/svc/a-warm", record(0))
            remote.answer()
            for provider in providers.values():
                await ours_range(provider, sizes.keys)
            await peer_range(client, sizes.keys)
            for round_ in range(sizes.rounds):
                # Rotate who goes first in each round.
                k = round_ % len(SIDES)
                for side in SIDES[k:] + SIDES[:k]:
                    if side == "aetcd":
                        changes, acked, spent = await peer_changes(client, remote, sizes.changes)
                        local = await peer_changes_local(client, writer, sizes.changes)
                        wall, range_cpu = await peer_range(client, sizes.keys)
                        wire_wall, wire_cpu = await peer_range(client, sizes.keys)
                        parsed_wall, parsed_cpu = await peer_range_decoded(client, sizes.keys)
                    else:
                        changes, acked, spent = await ours_changes(url, remote, sizes.changes, side)
                        local = await ours_changes_local(url, writer, sizes.changes, side)
                        wall, range_cpu = await ours_range(providers[side], sizes.keys)
                        wire_wall, wire_cpu = await wire_range(providers[side], sizes.keys)
                        parsed_wall, parsed_cpu = await ours_range(providers[side], sizes.keys)
                    wall_parsed[side].append(parsed_wall)
                    cpu_parsed[side].append(parsed_cpu)
                    wall_wire[side].append(wire_wall)
                    cpu_wire[side].append(wire_cpu)
                    seen[side] += changes
                    acks[side] += acked
                    seen_local[side] += local
                    cpu[side].append(spent)
                    wall_range[side].append(wall)
                    cpu_range[side].append(range_cpu)
        finally:
            remote.close()
            for provider in providers.values():
                await provider.aclose()
            await client.close()
    median = statistics.median

    def row(measure: str, values: dict[str, float], target: float, note: str = "") -> Row:
        return Row(
            measure,
            values["json"],
            values["grpc"],
            values["aetcd"],
            "ms",
            target,
            note or "(where it goes)",
        )

    def per_round(
        measure: str, rounds: dict[str, list[float]], target: float, note: str = ""
    ) -> Row:
        """A row measured once per round: medians in ms, and each side's
        ratio as the median of its rounds' ratios to the peer's same round."""
        peer = rounds["aetcd"]

        def ratio(side: str) -> float:
            pairs = zip(rounds[side], peer, strict=True)
            return median(o / p if p > 0 else math.inf for o, p in pairs)

        return Row(
            measure,
            median(rounds["json"]) * 1e3,
            median(rounds["grpc"]) * 1e3,
            median(peer) * 1e3,
            "ms",
            target,
            note or "(where it goes)",
            (ratio("json"), ratio("grpc")),
        )

    parsed = "(peer parses JSON)"

    return [
        row("put -> observed p50", {k: median(v) for k, v in seen.items()}, 1.0),
        row("put -> observed p99", {k: nearest_rank(v, 0.99) for k, v in seen.items()}, 2.0),
        row("put acked p99", {k: nearest_rank(v, 0.99) for k, v in acks.items()}, math.inf),
        row(
            "acked -> observed p99",
            {
                k: nearest_rank([o - a for o, a in zip(seen[k], v, strict=True)], 0.99)
                for k, v in acks.items()
            },
            math.inf,
        ),
        per_round("CPU per change", cpu, 1.0),
        row(
            "p50, writer on this loop",
            {k: median(v) for k, v in seen_local.items()},
            math.inf,
            "(one loop: writer + watch)",
        ),
        per_round(f"{sizes.keys:,}-key range wall", wall_range, 1.0),
        per_round(f"{sizes.keys:,}-key range CPU", cpu_range, 1.0),
        per_round("  of it, the wire wall", wall_wire, math.inf),
        per_round("  of it, the wire CPU", cpu_wire, math.inf),
        per_round("range wall, peer+json.loads", wall_parsed, math.inf, parsed),
        per_round("range CPU, peer+json.loads", cpu_parsed, math.inf, parsed),
    ]


def render(rows: Sequence[Row]) -> str:
    header = (
        f"{'measure':<27} {'json':>10} {'grpc':>10} {'aetcd':>10} "
        f"{'json/peer':>9} {'grpc/peer':>9}  target"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        verdict = r.note if math.isinf(r.target) else ("ok" if r.ok else "MISSED")
        lines.append(
            f"{r.measure:<27} {r.json:>8.2f}{r.unit} {r.grpc:>8.2f}{r.unit} {r.peer:>8.2f}{r.unit} "
            f"{r.json_ratio:>8.2f}x {r.ratio:>8.2f}x  "
            + (verdict if math.isinf(r.target) else f"<= {r.target:g}x (grpc) {verdict}")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="small sizes, one round")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"interleaved rounds (default {FULL.rounds}; more keep the CPU rows steady)",
    )
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error("--rounds must be at least 1")
        sizes = dataclasses.replace(sizes, rounds=args.rounds)
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
        f"etcd provider (json and grpc wires) vs aetcd on one etcd (loopback, asyncio), "
        f"{sizes.rounds} interleaved "
        f"round(s) of {sizes.changes} changes and one {sizes.keys:,}-key range; "
        f"load average {load}"
    )
    print(render(rows))
    return rows


if __name__ == "__main__":
    main()
