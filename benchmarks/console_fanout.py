"""Console fan-out: many WebSocket clients following 1,000 instances changing 50 times a second.

The owner (a MemoryProvider with watches: 20 services x 50 instances) and
its console run in this process on trio, served by hypercorn on loopback.
Every change replaces one instance of one service (round robin over the
services) by a new identity carrying the change number. The clients run in
a child process (trio-websocket): most read as fast as they can; "slow"
ones read one message per second with a small receive buffer. Measured:

* update latency: from the change (wall clock, this process) to the first
  message carrying it at one of 3 probe clients that parse every message
  (wall clock, the child), p50/p99/max; the other fast clients only read
  and count, so the one client process is not what is measured;
* the owner's added CPU: this process's CPU time per second with the
  clients connected, minus the same change workload with no console;
* latest-only: messages a slow client received (it reads one a second
  while the changes run, then catches up), and whether each slow client
  reached the final state after the changes stopped (it must, with a
  bounded number of messages, never a backlog). Messages already in the
  kernel's socket buffers are delivered as sent; beyond them the console
  keeps nothing per client but the versions it has seen.

Run: ``python -m benchmarks.console_fanout [--smoke]``
"""

# Polling here waits on other processes or on a server's side effects,
# which no single event covers.
# ruff: noqa: ASYNC110

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

FULL = {"clients": 100, "slow": 10, "services": 20, "per_service": 50, "rate": 50, "seconds": 10.0}
#: Fast clients that parse every message (latency and the final state).
PROBES = 3
SMOKE = {"clients": 8, "slow": 2, "services": 4, "per_service": 25, "rate": 50, "seconds": 2.0}


@dataclass
class Result:
    clients: int
    instances: int
    changes: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    base_cpu: float
    console_cpu: float
    fast_messages: float
    slow_messages: float
    slow_converged: int
    slow: int
    client_cpu: float


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


async def _workload(
    provider: Any,
    services: int,
    per: int,
    rate: float,
    seconds: float,
    start_k: int,
    stamps: dict[int, float],
) -> int:
    from nadisc import Instance

    k = start_k
    period = 1.0 / rate
    deadline = trio.current_time() + seconds
    next_at = trio.current_time()
    while trio.current_time() < deadline:
        svc = k % services
        slot = (k // services) % per
        current = list(provider.listing(f"svc{svc}").instances)
        current[slot] = Instance(f"s{svc}-i{slot}-v{k}", "10.1.0.1", 9000 + slot)
        stamps[k] = time.time()
        provider.set(f"svc{svc}", current)
        k += 1
        next_at += period
        await trio.sleep_until(next_at)
    return k


async def _owner_main(cfg: dict[str, Any]) -> Result:
    from nadisc import DiscoveryConfig, Instance, open_discovery
    from nadisc.observability import console_app, serve
    from nadisc.testing import MemoryProvider

    services, per = cfg["services"], cfg["per_service"]
    provider = MemoryProvider(services={f"svc{i}": f"svc{i}" for i in range(services)}, watch=True)
    for i in range(services):
        provider.set(
            f"svc{i}", [Instance(f"s{i}-i{j}-v0", "10.1.0.1", 9000 + j) for j in range(per)]
        )
    config = DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {"primary": {"provider": "host"}},
            "limits": {"max_watch_streams": max(64, services)},
        }
    )
    stamps: dict[int, float] = {}
    async with open_discovery(config, providers={"primary": provider}) as owner:
        held = [
            await owner.client().observe(f"svc{i}", trio.current_time() + 5)
            for i in range(services)
        ]
        # Baseline: the same changes, no console.
        cpu0 = time.process_time()
        k = await _workload(provider, services, per, cfg["rate"], cfg["seconds"], 1, stamps)
        base_cpu = (time.process_time() - cpu0) / cfg["seconds"]
        stamps.clear()
        app = console_app(owner, interval=0.05)
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(serve, app, "127.0.0.1:0")
            url = urls[0].replace("http", "ws") + "/ws"
            child = await trio.lowlevel.open_process(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.console_fanout",
                    "--child",
                    url,
                    json.dumps(cfg),
                ],
                stdout=subprocess.PIPE,
            )
            assert child.stdout is not None
            # Wait for every client to be connected.
            with trio.fail_after(60):
                while app.clients < cfg["clients"]:
                    await trio.sleep(0.05)
            await trio.sleep(1.0)
            first_k = k
            cpu0 = time.process_time()
            k = await _workload(provider, services, per, cfg["rate"], cfg["seconds"], k, stamps)
            console_cpu = (time.process_time() - cpu0) / cfg["seconds"]
            # Tell the child the final change number; it reports when done.
            output = b""
            with trio.fail_after(120):
                async for chunk in child.stdout:
                    output += chunk
            await child.wait()
            nursery.cancel_scope.cancel()
        del held
    report = json.loads(output.decode().strip().splitlines()[-1])
    latencies = [
        (seen - stamps[int(key)]) * 1000.0
        for key, seen in report["first_seen"].items()
        if int(key) in stamps
    ]
    return Result(
        clients=cfg["clients"],
        instances=services * per,
        changes=k - first_k,
        p50_ms=quantile(latencies, 0.5),
        p99_ms=quantile(latencies, 0.99),
        max_ms=max(latencies),
        base_cpu=base_cpu,
        console_cpu=console_cpu,
        fast_messages=report["fast_messages"],
        slow_messages=report["slow_messages"],
        slow_converged=report["slow_converged"],
        client_cpu=report["child_cpu"],
        slow=cfg["slow"],
    )


# ------------------------------------------------------------------ the clients (child)


async def _client(
    url: str, role: str, out: dict[str, Any], stop: trio.Event, drain_for: float
) -> None:
    """``probe``: parses every message (latency, final state); ``fast``: reads
    and counts only (a cheap client, so the client process is not the
    bottleneck); ``slow``: one message a second while the changes run."""
    from trio_websocket import wrap_client_stream

    slow = role == "slow"
    host, port = url.removeprefix("ws://").split("/")[0].split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    if slow:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    versions: dict[str, int] = {}
    messages = 0
    try:
        async with trio.open_nursery() as nursery:
            ws = await wrap_client_stream(nursery, stream, host, "/ws", message_queue_size=1)
            out["connected"] += 1
            while True:
                if stop.is_set() and trio.current_time() > out["stop_at"] + drain_for:
                    break
                with trio.move_on_after(0.5) as wait:
                    text = await ws.get_message()
                if wait.cancelled_caught:
                    continue
                messages += 1
                if role == "fast":
                    continue
                now = time.time()
                message = json.loads(text)
                # Instances come in chunks (one part each): the newest change per chunk.
                for key, chunk in message.get("instances", {}).items():
                    seen = [int(i["identity"].rsplit("-v", 1)[1]) for i in chunk]
                    versions[key] = max(seen)
                    if role == "probe":
                        for v in seen:
                            out["first_seen"].setdefault(v, now)
                if slow and not stop.is_set():
                    await trio.sleep(1.0)  # slow while the changes run; then catch up
            nursery.cancel_scope.cancel()
    finally:
        await stream.aclose()
    out[f"{role}_messages"].append(messages)
    out["final"].append((role, versions))


async def _child_main(url: str, cfg: dict[str, Any]) -> None:
    started = time.monotonic()
    out: dict[str, Any] = {
        "first_seen": {},
        "fast_messages": [],
        "probe_messages": [],
        "slow_messages": [],
        "final": [],
        "connected": 0,
        "stop_at": math.inf,
    }
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for n in range(cfg["clients"]):
            role = "slow" if n < cfg["slow"] else "probe" if n < cfg["slow"] + PROBES else "fast"
            nursery.start_soon(_client, url, role, out, stop, cfg.get("drain", 4.0))
        while out["connected"] < cfg["clients"]:
            await trio.sleep(0.05)
        # The owner starts changing 1 s after everyone connected, for cfg
        # seconds; then everyone drains for 4 s more (slow ones read 1/s).
        await trio.sleep(cfg["seconds"] + 1.5)
        out["stop_at"] = trio.current_time()
        stop.set()
    fast_final = [v for role, v in out["final"] if role == "probe"]
    newest = {k: max(f.get(k, 0) for f in fast_final) for k in fast_final[0]} if fast_final else {}
    converged = sum(1 for role, v in out["final"] if role == "slow" and v == newest)
    fast = out["fast_messages"] + out["probe_messages"]
    slow = out["slow_messages"]
    print(
        json.dumps(
            {
                "first_seen": {str(k): v for k, v in out["first_seen"].items()},
                "fast_messages": sum(fast) / max(1, len(fast)),
                "slow_messages": sum(slow) / max(1, len(slow)),
                "slow_converged": converged,
                "child_cpu": time.process_time() / max(1e-9, time.monotonic() - started),
            }
        )
    )


def print_table(r: Result) -> None:
    print(
        f"console fan-out: {r.clients} clients ({r.slow} slow), {r.instances} instances, "
        f"{r.changes} changes"
    )
    print(
        f"{'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'CPU no console':>15} "
        f"{'CPU console':>12} {'added CPU':>10} {'msgs fast':>10} {'msgs slow':>10} "
        f"{'slow at newest':>15} {'client proc CPU':>16}"
    )
    print(
        f"{r.p50_ms:8.1f} {r.p99_ms:8.1f} {r.max_ms:8.1f} {r.base_cpu * 100:14.1f}% "
        f"{r.console_cpu * 100:11.1f}% {(r.console_cpu - r.base_cpu) * 100:9.1f}% "
        f"{r.fast_messages:10.1f} {r.slow_messages:10.1f} {r.slow_converged:>12}/{r.slow:<2} "
        f"{r.client_cpu * 100:15.1f}%"
    )


# ------------------------------------------------------------------ pages: the scenario

PAGES_FULL: dict[str, Any] = {
    "big": 1000, "small": 20, "per_small": 3, "rate": 20, "seconds": 15.0, "tabs": 3,
    "drain": 2.0, "slow_period": 1.0,
}  # fmt: skip
PAGES_SMOKE: dict[str, Any] = {
    "big": 200, "small": 4, "per_small": 3, "rate": 20, "seconds": 1.0, "tabs": 1,
    "drain": 0.5, "slow_period": 0.3,
}  # fmt: skip
PAGES_INTERVAL = 0.1

#: Installed in each page once it rendered: records when each instance row
#: appears (wall clock, the system's, as the owner's stamps).
_WATCH_ROWS = """
window.__seen = [];
new MutationObserver((records) => {
  const t = performance.timeOrigin + performance.now();
  for (const r of records) for (const n of r.addedNodes) {
    if (n.nodeType !== 1) continue;
    const rows = n.matches('[data-instance]') ? [n] : n.querySelectorAll('[data-instance]');
    for (const row of rows) window.__seen.push([row.dataset.instance, t]);
  }
}).observe(document.getElementById('services'), {childList: true, subtree: true});
true
"""


@dataclass
class PagesResult:
    big: int
    small: int
    changes: int
    small_changes: int
    first_render_ms: list[float]
    pages: list[tuple[int, float, float, float]]  # (seen, p50, p99, max) per tab
    slow_reads: int
    slow_max_lag_ms: float
    full_bytes: int
    big_msgs: tuple[int, float]  # (messages, mean bytes) carrying the big service
    small_msgs: tuple[int, float]  # (messages, mean bytes) of small services only
    bytes_per_change: float
    big_part_bytes: int
    load: float


async def _pages_main(cfg: dict[str, Any], profile: str) -> PagesResult:
    import os

    from trio_websocket import open_websocket_url

    from nadisc import DiscoveryConfig, Instance, open_discovery
    from nadisc.observability import console_app, serve
    from nadisc.testing import MemoryProvider
    from tests.observability.chromium import open_chromium

    big, small, per = cfg["big"], cfg["small"], cfg["per_small"]
    names = {"big": "big", **{f"sm{i:02d}": f"sm{i:02d}" for i in range(small)}}
    provider = MemoryProvider(services=names, watch=True)
    provider.set("big", [Instance(f"big-{j}-v0", "10.2.0.1", 1000 + j) for j in range(big)])
    for i in range(small):
        provider.set(
            f"sm{i:02d}", [Instance(f"sm{i:02d}-{j}-v0", "10.3.0.1", 2000 + j) for j in range(per)]
        )
    config = DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"primary": {"provider": "host"}}}
    )
    stamps: dict[str, float] = {}
    probe: dict[str, Any] = {"big": [], "small": [], "bytes": 0, "full": 0}
    slow_lags: list[float] = []
    async with open_discovery(config, providers={"primary": provider}) as owner:
        held = [await owner.client().observe(n, trio.current_time() + 10) for n in names]
        app = console_app(owner, interval=PAGES_INTERVAL)
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(serve, app, "127.0.0.1:0")
            ws = urls[0].replace("http", "ws") + "/ws?ack=1"
            done = trio.Event()

            async def probe_client() -> None:
                # Reads and acks every message, as the page does; counts bytes.
                async with open_websocket_url(ws, max_message_size=1 << 26) as socket:
                    first = await socket.get_message()
                    probe["full"] = len(first)
                    await socket.send_message('{"ack":0}')
                    while not done.is_set():
                        text = await socket.get_message()
                        await socket.send_message('{"ack":0}')
                        message = json.loads(text)
                        if message["type"] == "tick":
                            continue
                        probe["bytes"] += len(text)
                        kind = "big" if "primary/big" in message["services"] else "small"
                        probe[kind].append(len(text))

            async def slow_client() -> None:
                # Deliberately slow: one read a second; acks just before reading.
                async with open_websocket_url(ws, max_message_size=1 << 26) as socket:
                    await socket.get_message()
                    while not done.is_set():
                        await trio.sleep(cfg["slow_period"])
                        await socket.send_message('{"ack":0}')
                        message = json.loads(await socket.get_message())
                        slow_lags.append(trio.current_time() - float(message["sampled"]))

            async with open_chromium(Path(profile)) as browser:
                pages = [
                    await browser.open_page(urls[0] + "/", width=1400, height=900)
                    for _ in range(cfg["tabs"])
                ]
                renders = []
                for page in pages:
                    await page.wait_for(
                        "document.body && document.body.dataset.firstRenderMs", timeout=60
                    )
                    renders.append(
                        float(await page.evaluate("document.body.dataset.firstRenderMs"))
                    )
                    await page.evaluate(_WATCH_ROWS)
                nursery.start_soon(probe_client)
                nursery.start_soon(slow_client)
                await trio.sleep(cfg["drain"])
                k = 0
                period = 1.0 / cfg["rate"]
                next_at = trio.current_time()
                deadline = next_at + cfg["seconds"]
                while trio.current_time() < deadline:
                    k += 1
                    if k % 2:
                        slot = (k // 2) % big
                        current = list(provider.listing("big").instances)
                        current[slot] = Instance(f"big-{slot}-v{k}", "10.2.0.1", 1000 + slot)
                        provider.set("big", current)
                    else:
                        svc = f"sm{(k // 2) % small:02d}"
                        slot = (k // 2 // small) % per
                        current = list(provider.listing(svc).instances)
                        identity = f"{svc}-{slot}-v{k}"
                        current[slot] = Instance(identity, "10.3.0.1", 2000 + slot)
                        stamps[identity] = time.time() * 1000.0
                        provider.set(svc, current)
                    next_at += period
                    await trio.sleep_until(next_at)
                await trio.sleep(cfg["drain"])  # let every page catch up
                seen_per_page = [await page.evaluate("window.__seen") for page in pages]
                done.set()
            nursery.cancel_scope.cancel()
        big_part = len(
            json.dumps([[i.identity, i.host] for i in provider.listing("big").instances])
        )
        del held
    rows = []
    for seen in seen_per_page:
        first: dict[str, float] = {}
        for identity, at in seen:
            if identity in stamps and identity not in first:
                first[identity] = at
        latencies = [first[i] - stamps[i] for i in first]
        if latencies:
            rows.append(
                (len(first), quantile(latencies, 0.5), quantile(latencies, 0.99), max(latencies))
            )
        else:
            rows.append((0, math.nan, math.nan, math.nan))
    bigs, smalls = probe["big"], probe["small"]
    return PagesResult(
        big=big,
        small=small,
        changes=k,
        small_changes=len(stamps),
        first_render_ms=renders,
        pages=rows,
        slow_reads=len(slow_lags),
        slow_max_lag_ms=max(slow_lags, default=math.nan) * 1000.0,
        full_bytes=probe["full"],
        big_msgs=(len(bigs), sum(bigs) / max(1, len(bigs))),
        small_msgs=(len(smalls), sum(smalls) / max(1, len(smalls))),
        bytes_per_change=probe["bytes"] / max(1, k),
        big_part_bytes=big_part,
        load=os.getloadavg()[0],
    )


def print_pages(r: PagesResult, cfg: dict[str, Any]) -> None:
    print(
        f"console pages: 1 service x {r.big} instances + {r.small} x {cfg['per_small']}, "
        f"{cfg['rate']} changes/s for {cfg['seconds']:g} s ({r.changes} changes, "
        f"{r.small_changes} to small services), interval {PAGES_INTERVAL * 1000:.0f} ms, "
        f"{cfg['tabs']} Chromium tabs + 1 slow client, load average {r.load:.1f}"
    )
    print(
        f"{'client':<8} {'first render ms':>16} {'changes seen':>13} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
    )
    for n, (seen, p50, p99, worst) in enumerate(r.pages):
        print(
            f"{'page ' + str(n + 1):<8} {r.first_render_ms[n]:16.0f} {seen:>13} "
            f"{p50:8.1f} {p99:8.1f} {worst:8.1f}"
        )
    print(
        f"slow client: {r.slow_reads} reads (one per {cfg['slow_period']:g} s), "
        "newest sample at most "
        f"{r.slow_max_lag_ms:.0f} ms old when read (interval {PAGES_INTERVAL * 1000:.0f} ms)"
    )
    print(
        f"bytes: full state {r.full_bytes}; deltas with the big service {r.big_msgs[1]:.0f} "
        f"({r.big_msgs[0]} msgs; its ids+hosts alone {r.big_part_bytes}); deltas of small "
        f"services only {r.small_msgs[1]:.0f} ({r.small_msgs[0]} msgs); per change "
        f"{r.bytes_per_change:.0f}"
    )


def main(argv: list[str] | None = None) -> Result | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a small, short run")
    parser.add_argument("--clients", type=int, help="override the number of clients")
    parser.add_argument("--seconds", type=float, help="override the change window")
    parser.add_argument(
        "--pages",
        action="store_true",
        help="the page scenario: one 1,000-instance service, 20 small ones, Chromium tabs",
    )
    parser.add_argument("--child", nargs=2, metavar=("URL", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        trio.run(_child_main, args.child[0], json.loads(args.child[1]))
        return None
    if args.pages:
        import tempfile

        pages_cfg = dict(PAGES_SMOKE if args.smoke else PAGES_FULL)
        if args.seconds:
            pages_cfg["seconds"] = args.seconds
        with tempfile.TemporaryDirectory() as profile:
            pages = trio.run(_pages_main, pages_cfg, profile)
        print_pages(pages, pages_cfg)
        return None
    cfg = dict(SMOKE if args.smoke else FULL)
    if args.clients:
        cfg["clients"] = args.clients
        cfg["slow"] = min(cfg["slow"], max(0, args.clients - PROBES - 1))
    if args.seconds:
        cfg["seconds"] = args.seconds
    result = trio.run(_owner_main, cfg)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
