"""Nacos at scale: decoding a large instance list, and many ephemeral registrations.

1. Decode: one v1 ``/instance/list`` answer of N hosts (the documented host
   shape, Spring-Cloud-style metadata). ``json.loads`` of the bytes alone is
   the baseline (what a thin client hands its users before any work); the
   provider's decoder goes all the way to the typed ``ProviderSnapshot``
   (validation, eligibility, ``Instance`` objects). Each round times both
   best-of-several, interleaved, and takes the ratio within the round; the
   median round is the headline (target <= 0.5x), the worst is printed too.
   Also timed: a decode given the previous snapshot (instances reused), and
   an unchanged poll (content digest equal: nothing decoded).
2. Beats: R ephemeral registrations on **one** connection (one provider, one
   httpx pool) renewed by light beats against the Nacos fake served by
   hypercorn in a separate process on loopback (so its CPU is not ours).
   Reported per offered rate: beats per second sustained, the client's CPU
   per beat (process CPU time / acknowledged beats), beat latency p50/p99,
   and the worst lateness of a 5 ms ticker on the same loop (target: loop
   stall <= 25 ms), beside the longest single task step (our own code
   holding the loop; the ticker also counts time the OS gave to others).

Run ``python -m benchmarks.nacos_scale [--smoke]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import trio
from nadisc_nacos import NacosProvider, NacosSettings, decode_instance_list
from nadisc_nacos._wire import listing_digest

from nadisc import ConnectionContext, OutcomeUnknown, RegistrationRecord


def instance_list(hosts: int) -> bytes:
    entries = []
    for i in range(hosts):
        ip = f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"
        entries.append(
            {
                "instanceId": f"{ip}#8080#DEFAULT#BUSINESS@@order-worker",
                "ip": ip,
                "port": 8080,
                "weight": 1.0,
                "healthy": True,
                "enabled": True,
                "ephemeral": True,
                "clusterName": "DEFAULT",
                "serviceName": "BUSINESS@@order-worker",
                "metadata": {
                    "preserved.register.source": "SPRING_CLOUD",
                    "version": "1.4.2",
                    "zone": f"zone-{i % 3}",
                },
                "instanceHeartBeatInterval": 5000,
                "instanceHeartBeatTimeOut": 15000,
                "ipDeleteTimeout": 30000,
                "instanceIdGenerator": "simple",
            }
        )
    document = {
        "name": "BUSINESS@@order-worker",
        "groupName": "BUSINESS",
        "clusters": "",
        "cacheMillis": 10000,
        "hosts": entries,
        "lastRefTime": 1700000000000,
        "checksum": "",
        "allIPs": False,
        "reachProtectionThreshold": False,
        "valid": True,
    }
    return json.dumps(document).encode()


def best_of(repeats: int, work: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def decode_rounds(hosts: int, rounds: int, repeats: int) -> dict[str, Any]:
    body = instance_list(hosts)

    def typed(previous: Any = None) -> Any:
        return decode_instance_list(
            body,
            api="v1",
            service="order-worker",
            group="BUSINESS",
            max_bytes=len(body) + 1,
            max_instances=hosts,
            previous=previous,
        )

    first = typed().snapshot
    assert len(first.instances) == hosts
    cold: list[float] = []
    warm: list[float] = []
    unchanged: list[float] = []
    loads_times: list[float] = []
    for _ in range(rounds):
        loads = typed_time = warm_time = digest_time = float("inf")
        for _ in range(repeats):  # interleaved, so both see the same machine
            loads = min(loads, best_of(1, lambda: json.loads(body)))
            typed_time = min(typed_time, best_of(1, typed))
            warm_time = min(warm_time, best_of(1, lambda: typed(first)))
            digest_time = min(digest_time, best_of(1, lambda: listing_digest(body)))
        loads_times.append(loads)
        cold.append(typed_time / loads)
        warm.append(warm_time / loads)
        unchanged.append(digest_time / loads)
    return {
        "hosts": hosts,
        "bytes": len(body),
        "loads": statistics.median(loads_times),
        "ratio": statistics.median(cold),
        "worst_ratio": max(cold),
        "warm_ratio": statistics.median(warm),
        "unchanged_ratio": statistics.median(unchanged),
    }


# -- beats -----------------------------------------------------------------------------------


def serve() -> None:
    """``--serve``: the fake on a loopback port; prints its URL, runs until stdin closes."""
    from tests.fakes.nacos import run_nacos_fake

    async def main() -> None:
        async with run_nacos_fake() as fake:
            print(fake.url, flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)

    trio.run(main)


class _Steps(trio.abc.Instrument):
    """The longest single task step: how long our own code held the loop at
    a stretch (the ticker's lateness also counts time the OS gave to others)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.longest = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.started is not None:  # the step that added us had no "before"
            self.longest = max(self.longest, time.perf_counter() - self.started)
        self.started = None


def in_memory_server() -> httpx.AsyncBaseTransport:
    """Nacos's v1 answers from memory: the client's own cost, no server."""
    beat = b'{"clientBeatInterval":5000,"code":10200,"lightBeatEnabled":true}'

    def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/instance/beat"):
            return httpx.Response(200, content=beat)
        if path.endswith("/instance/list"):
            return httpx.Response(200, content=b'{"hosts":[],"cacheMillis":10000}')
        if request.method == "GET":  # instance detail
            return httpx.Response(404, content=b"no matched ip found!")
        return httpx.Response(200, content=b"ok")

    return httpx.MockTransport(answer)


async def beat_round(
    url: str | None, registrations: int, interval: float, duration: float
) -> dict[str, float]:
    settings = NacosSettings.model_validate(
        {
            "server_addr": url or "http://in-memory:8848/nacos",
            "api": "v1",
            "group": "BUSINESS",
            "beat_interval": interval,
        }
    )
    provider = NacosProvider(
        ConnectionContext("bench", 5.0, 4096, 8 << 20),
        settings,
        transport=None if url else in_memory_server(),
    )
    await provider.prepare(trio.current_time() + 10)
    records = [
        RegistrationRecord(
            registration=f"r{n}",
            service="order-api",
            instance_id=f"i{n}",
            host=f"10.9.{n >> 8}.{n & 255}",
            port=18080,
        )
        for n in range(registrations)
    ]
    registered: list[Any] = [None] * registrations

    async def register(index: int) -> None:
        for attempt in range(3):  # a write whose answer was lost: try again
            try:
                registered[index] = await provider.register(
                    records[index], trio.current_time() + 60
                )
                return
            except OutcomeUnknown:
                if attempt == 2:
                    raise

    async with trio.open_nursery() as nursery:  # the shell's gate bounds the concurrency
        for index in range(registrations):
            nursery.start_soon(register, index)
    latencies: list[float] = []
    failures = [0]
    worst_stall = [0.0]
    steps = _Steps()

    async def ticker() -> None:
        while True:
            expected = trio.current_time() + 0.005
            await trio.sleep(0.005)
            worst_stall[0] = max(worst_stall[0], trio.current_time() - expected)

    async def beater(index: int, stop: float) -> None:
        # spread the first beats over one interval, as registrations would be
        await trio.sleep(interval * index / registrations)
        while trio.current_time() < stop:
            started = trio.current_time()
            try:
                await provider.renew(registered[index], started + 5)
            except Exception:  # counted; the benchmark goes on
                failures[0] += 1
            else:
                latencies.append(trio.current_time() - started)
            await trio.sleep(max(0.0, started + interval - trio.current_time()))

    gc.collect()
    cpu = time.process_time()
    wall = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.2)
        worst_stall[0] = 0.0
        trio.lowlevel.add_instrument(steps)
        try:
            async with trio.open_nursery() as beaters:
                stop = trio.current_time() + duration
                for index in range(registrations):
                    beaters.start_soon(beater, index, stop)
        finally:
            trio.lowlevel.remove_instrument(steps)
        nursery.cancel_scope.cancel()
    wall = trio.current_time() - wall
    cpu = time.process_time() - cpu
    await provider.aclose()  # the server process goes away with its registrations
    latencies.sort()
    beats = len(latencies)
    return {
        "offered": registrations / interval,
        "beats_per_s": beats / duration,
        "cpu_per_beat_us": cpu / max(1, beats) * 1e6,
        "p50_ms": latencies[beats // 2] * 1000 if beats else float("nan"),
        "p99_ms": latencies[min(beats - 1, int(beats * 0.99))] * 1000 if beats else float("nan"),
        "stall_ms": worst_stall[0] * 1000,
        "step_ms": steps.longest * 1000,
        "failures": failures[0],
        "wall": wall,
    }


def memory_rounds(
    registrations: int, intervals: list[float], duration: float
) -> list[dict[str, float]]:
    return [trio.run(beat_round, None, registrations, i, duration) for i in intervals]


def beat_rounds(
    registrations: int, intervals: list[float], duration: float
) -> list[dict[str, float]]:
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.nacos_scale", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        return [trio.run(beat_round, url, registrations, i, duration) for i in intervals]
    finally:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.close()
        server.wait(timeout=10)
        server.stdout.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small and quick")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return {}
    hosts = 4096
    decoded = decode_rounds(hosts, rounds=2 if args.smoke else 5, repeats=3 if args.smoke else 9)
    # The smoke run (a test) keeps the full 4,096-host decode but beats with
    # 32 registrations for 1 s: the pure-Python fake server is slow to fill.
    registrations = 32 if args.smoke else 256
    intervals = [1.0] if args.smoke else [5.0, 2.0, 1.0]
    duration = 1.0 if args.smoke else 20.0
    beats = beat_rounds(registrations, intervals, duration=duration)
    memory = memory_rounds(registrations, intervals, duration=duration)

    print(f"{'nacos instance list decode':<40} {'value':>12}  note")
    print("-" * 78)
    print(f"{'hosts / body':<40} {hosts:>6} {decoded['bytes'] / 1024:>5.0f}K")
    print(f"{'json.loads':<40} {decoded['loads'] * 1000:>10.2f}ms  median round, best of each")
    print(
        f"{'typed snapshot / json.loads (median)':<40} {decoded['ratio']:>11.2f}x  target <= 0.50x"
    )
    print(f"{'  worst round':<40} {decoded['worst_ratio']:>11.2f}x")
    print(f"{'previous snapshot given / json.loads':<40} {decoded['warm_ratio']:>11.2f}x  reused")
    unchanged = decoded["unchanged_ratio"]
    print(f"{'unchanged poll (digest) / json.loads':<40} {unchanged:>11.2f}x  no decode")
    print()
    print(f"{registrations} ephemeral registrations, one connection, light beats over loopback")
    print(
        f"{'server':>10} {'interval s':>10} {'offered/s':>10} {'beats/s':>9} {'CPU/beat us':>12}"
        f" {'p50 ms':>8} {'p99 ms':>8} {'max stall ms':>13} {'longest step ms':>16}"
        f" {'failed':>7}"
    )
    rows = [("loopback", i, r) for i, r in zip(intervals, beats, strict=True)]
    rows += [("in-memory", i, r) for i, r in zip(intervals, memory, strict=True)]
    for where, interval, row in rows:
        print(
            f"{where:>10} "
            f"{interval:>10.1f} {row['offered']:>10.1f} {row['beats_per_s']:>9.1f}"
            f" {row['cpu_per_beat_us']:>12.0f} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}"
            f" {row['stall_ms']:>13.2f} {row['step_ms']:>16.2f} {int(row['failures']):>7}"
        )
    print("target: loop stall <= 25 ms")
    load = os.getloadavg()[0]
    print(f"machine load average (1 min) at the end: {load:.1f} on {os.cpu_count()} CPUs")
    print("loopback: the fake served by hypercorn in another process (pure Python, the")
    print("throughput limit); in-memory: Nacos's answers from an httpx mock transport,")
    print("so the CPU and stall columns are the client's own")
    return {"decode": decoded, "beats": beats, "memory": memory}


if __name__ == "__main__":
    main()
