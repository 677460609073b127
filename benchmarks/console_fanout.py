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
import gc
import json
import math
import socket
import subprocess
import sys
import time
from contextlib import AsyncExitStack
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
    "drain": 2.0, "slow_period": 1.0, "hog": 0,
}  # fmt: skip
PAGES_SMOKE: dict[str, Any] = {
    "big": 200, "small": 4, "per_small": 3, "rate": 20, "seconds": 1.5, "tabs": 1,
    "drain": 0.5, "slow_period": 0.3, "hog": 0,
}  # fmt: skip
PAGES_INTERVAL = 0.1

#: Installed in each page once it rendered: records when each instance row
#: appears: when the DOM had it, and the start of the next animation frame
#: (the frame that showed the row was painted by then; the latency columns
#: use this one), on the system's wall clock as the owner's stamps.
_WATCH_ROWS = """
window.__seen = [];
window.nadiscProfile = [];
new MutationObserver((records) => {
  const ids = [];
  for (const r of records) for (const n of r.addedNodes) {
    if (n.nodeType !== 1) continue;
    const rows = n.matches('[data-instance]') ? [n] : n.querySelectorAll('[data-instance]');
    for (const row of rows) ids.push(row.dataset.instance);
  }
  const dom = performance.timeOrigin + performance.now();
  if (ids.length) requestAnimationFrame(() => {
    const t = performance.timeOrigin + performance.now();
    for (const id of ids) window.__seen.push([id, t, dom]);
  });
}).observe(document.getElementById('services'), {childList: true, subtree: true});
true
"""

_HOG = "import time\nwhile True:\n    time.perf_counter()\n"


@dataclass
class PagesResult:
    big: int
    small: int
    changes: int
    small_changes: int
    first_render_ms: list[float]
    #: (label, changes seen, p50, p99, max) per tab
    pages: list[tuple[str, int, float, float, float]]
    slow_reads: int
    slow_max_lag_ms: float
    full_bytes: int
    big_msgs: tuple[int, float]  # (messages, mean bytes) carrying the big service
    small_msgs: tuple[int, float]  # (messages, mean bytes) of small services only
    bytes_per_change: float
    #: bytes per changed instance: (messages with a big-service change, with small only)
    per_instance: tuple[float, float]
    #: the largest message carrying exactly one changed instance (bytes)
    one_change_max: int
    big_part_bytes: int
    #: where the time goes: name -> (calls, p50 ms, p99 ms, max ms)
    costs: dict[str, tuple[int, float, float, float]]
    #: per page: main-thread busy share by phase while the changes ran (DevTools metrics)
    busy: list[dict[str, float]]
    #: the owner's process (owner, console, hypercorn, the probe clients):
    #: CPU seconds per second while the changes ran
    server_cpu: float
    #: per page: p99 to the DOM having the row (before its frame was painted)
    dom_p99: list[float]
    #: change -> the probe WebSocket client (in the owner's process): seen, p50, p99, max
    delivered: tuple[int, float, float, float]
    #: per page: the 3 slowest changes, (latency ms, ms into the run)
    worst: dict[int, list[tuple[float, float]]]
    #: (service, instances changed at once, bytes sent for it, messages)
    calibration: list[tuple[str, int, int, int]]
    load: tuple[float, float]  # load average (1 min) before and after


def _start_hogs(count: int) -> list[subprocess.Popen[bytes]]:
    """CPU-bound processes that load the machine beside the run (killed after it)."""
    return [
        subprocess.Popen([sys.executable, "-c", _HOG], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]


async def _loop_lag(out: list[float]) -> None:
    """How late the owner's event loop wakes a 10 ms sleep (ms), all run long."""
    while True:
        t0 = time.perf_counter()
        await trio.sleep(0.01)
        out.append((time.perf_counter() - t0 - 0.01) * 1000.0)


async def _page_metrics(page: Any) -> dict[str, float]:
    listed = (await page.send("Performance.getMetrics"))["metrics"]
    return {m["name"]: float(m["value"]) for m in listed}


def _costs(values: list[float]) -> tuple[int, float, float, float]:
    if not values:
        return (0, math.nan, math.nan, math.nan)
    return (len(values), quantile(values, 0.5), quantile(values, 0.99), max(values))


def _instance_changes(state: dict[str, str], message: dict[str, Any]) -> tuple[int, int]:
    """(changed instances in the big service, in small ones) that ``message``
    carries, against the chunks a client held before (``state`` is updated)."""
    big = small = 0
    for mark, chunk in message.get("instances", {}).items():
        old = {json.dumps(i, sort_keys=True) for i in json.loads(state.get(mark, "[]"))}
        new = [json.dumps(i, sort_keys=True) for i in chunk]
        moved = sum(1 for i in new if i not in old)
        state[mark] = json.dumps(chunk)
        if mark.startswith("primary/big#"):
            big += moved
        else:
            small += moved
    return big, small


async def _pages_main(cfg: dict[str, Any], profile: str) -> PagesResult:
    import os

    from trio_websocket import open_websocket_url

    from nadisc import DiscoveryConfig, Instance, open_discovery
    from nadisc.observability import _model, console_app, serve
    from nadisc.testing import MemoryProvider
    from tests.observability.chromium import open_chromium

    load_before = os.getloadavg()[0]
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
    probe: dict[str, Any] = {"big": [], "small": [], "bytes": 0, "full": 0, "per": ([], [])}
    probe["one"] = 0
    probe["log"] = []
    probe["first"] = {}
    slow_lags: list[float] = []
    calibration: list[tuple[str, int, int, int]] = []
    server: dict[str, list[float]] = {"sample": [], "delta": [], "loop lag": [], "gc": []}
    gc_started = [0.0]

    def gc_pause(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            server["gc"].append((time.perf_counter() - gc_started[0]) * 1000.0)

    gc.callbacks.append(gc_pause)
    # Server-side costs: every sample and every message built, timed in place.
    real_resample = _model.ConsoleModel.resample
    real_delta = _model.ConsoleSample.delta

    def timed_resample(self: Any, now: float | None = None) -> Any:
        t0 = time.perf_counter()
        try:
            return real_resample(self, now)
        finally:
            server["sample"].append((time.perf_counter() - t0) * 1000.0)

    def timed_delta(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real_delta(self, *args, **kwargs)
        finally:
            server["delta"].append((time.perf_counter() - t0) * 1000.0)

    hogs = _start_hogs(cfg["hog"])
    _model.ConsoleModel.resample = timed_resample  # type: ignore[method-assign]
    _model.ConsoleSample.delta = timed_delta  # type: ignore[method-assign]
    try:
        async with open_discovery(config, providers={"primary": provider}) as owner:
            held = [await owner.client().observe(n, trio.current_time() + 10) for n in names]
            app = console_app(owner, interval=PAGES_INTERVAL)
            async with trio.open_nursery() as nursery:
                urls = await nursery.start(serve, app, "127.0.0.1:0")
                ws = urls[0].replace("http", "ws") + "/ws?ack=1"
                done = trio.Event()

                async def probe_client() -> None:
                    # Reads and acks every message, as the page does; counts bytes.
                    chunks: dict[str, str] = {}
                    async with open_websocket_url(ws, max_message_size=1 << 26) as socket:
                        first = await socket.get_message()
                        probe["full"] = len(first)
                        _instance_changes(chunks, json.loads(first))
                        await socket.send_message('{"ack":0}')
                        while not done.is_set():
                            text = await socket.get_message()
                            await socket.send_message('{"ack":0}')
                            message = json.loads(text)
                            if message["type"] == "tick":
                                continue
                            got = time.time() * 1000.0
                            for chunk in message.get("instances", {}).values():
                                for instance in chunk:
                                    probe["first"].setdefault(instance["identity"], got)
                            moved_big, moved_small = _instance_changes(chunks, message)
                            probe["log"].append((moved_big, moved_small, len(text)))
                            probe["bytes"] += len(text)
                            if moved_big + moved_small == 1:
                                probe["one"] = max(probe["one"], len(text))
                            if moved_big:
                                probe["big"].append(len(text))
                                probe["per"][0].append(len(text) / (moved_big + moved_small))
                            elif moved_small:
                                probe["small"].append(len(text))
                                probe["per"][1].append(len(text) / moved_small)

                async def slow_client() -> None:
                    # Deliberately slow: one read a second; acks just before reading.
                    async with open_websocket_url(ws, max_message_size=1 << 26) as socket:
                        await socket.get_message()
                        while not done.is_set():
                            await trio.sleep(cfg["slow_period"])
                            await socket.send_message('{"ack":0}')
                            message = json.loads(await socket.get_message())
                            slow_lags.append(trio.current_time() - float(message["sampled"]))

                async with AsyncExitStack() as stack:
                    # Separate browsers (each its own process and window, in
                    # front): a background tab gets no animation frames.
                    pages = []
                    for n in range(cfg["tabs"]):
                        browser = await stack.enter_async_context(
                            open_chromium(Path(profile) / f"browser{n}")
                        )
                        pages.append(await browser.open_page(urls[0] + "/", width=1400, height=900))
                    renders = []
                    for page in pages:
                        await page.wait_for(
                            "document.body && document.body.dataset.firstRenderMs", timeout=60
                        )
                        renders.append(
                            float(await page.evaluate("document.body.dataset.firstRenderMs"))
                        )
                        await page.evaluate(_WATCH_ROWS)
                    # The first tab opens the big card: its rows are on the page
                    # and every change to it must show there too.
                    card = "document.querySelector('[data-service=\"primary/big\"]')"
                    await pages[0].evaluate(f"{card}.querySelector('button.toggle').click()")
                    await pages[0].wait_for(
                        f"{card}.querySelectorAll('[data-instance]').length === {big}"
                    )
                    await pages[0].evaluate("window.__seen = []")
                    for page in pages:
                        await page.send("Performance.enable")
                    metrics_before = [await _page_metrics(page) for page in pages]
                    nursery.start_soon(probe_client)
                    nursery.start_soon(slow_client)
                    nursery.start_soon(_loop_lag, server["loop lag"])
                    await trio.sleep(cfg["drain"])
                    if cfg.get("gc_freeze"):
                        gc.freeze()  # what is alive now is never scanned again
                    for values in server.values():
                        values.clear()
                    k = 0
                    period = 1.0 / cfg["rate"]
                    next_at = trio.current_time()
                    deadline = next_at + cfg["seconds"]
                    cpu0 = time.process_time()
                    while trio.current_time() < deadline:
                        k += 1
                        if k % 2:
                            slot = (k // 2) % big
                            svc, identity = "big", f"big-{slot}-v{k}"
                            current = list(provider.listing("big").instances)
                            current[slot] = Instance(identity, "10.2.0.1", 1000 + slot)
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
                    churned = k
                    server_cpu = (time.process_time() - cpu0) / cfg["seconds"]
                    await trio.sleep(cfg["drain"])  # let every page catch up
                    metrics_after = [await _page_metrics(page) for page in pages]
                    # A page that is still behind gets up to 30 s more (its
                    # late rows count with their real latency).
                    small_ids = {i for i in stamps if not i.startswith("big-")}
                    with trio.move_on_after(30):
                        for n, page in enumerate(pages):
                            wanted = set(stamps) if n == 0 else small_ids
                            while not wanted <= {
                                row[0] for row in await page.evaluate("window.__seen")
                            }:
                                await trio.sleep(0.1)
                    seen_per_page = [await page.evaluate("window.__seen") for page in pages]
                    # Bytes against what changed: n instances of the big
                    # service (each in a chunk of its own), then one small one.
                    for n, svc in ((1, "big"), (2, "big"), (5, "big"), (20, "big"), (1, "sm00")):
                        mark = len(probe["log"])
                        current = list(provider.listing(svc).instances)
                        step = max(1, len(current) // n)
                        for j in range(n):
                            slot = (j * step + 3) % len(current)
                            k += 1
                            current[slot] = Instance(f"{svc}-{slot}-v{k}", "10.4.0.1", 3000 + slot)
                        provider.set(svc, current)
                        with trio.fail_after(30):
                            while not any(b + s_ >= n for b, s_, _ in probe["log"][mark:]):
                                await trio.sleep(0.01)
                        carried = [e for e in probe["log"][mark:] if e[0] + e[1]]
                        calibration.append((svc, n, sum(e[2] for e in carried), len(carried)))
                    profiles = [await page.evaluate("window.nadiscProfile") for page in pages]
                    done.set()
                nursery.cancel_scope.cancel()
            big_part = len(
                json.dumps([[i.identity, i.host] for i in provider.listing("big").instances])
            )
            del held
    finally:
        _model.ConsoleModel.resample = real_resample  # type: ignore[method-assign]
        _model.ConsoleSample.delta = real_delta  # type: ignore[method-assign]
        gc.callbacks.remove(gc_pause)
        for hog in hogs:
            hog.kill()
            hog.wait()
    rows = []
    worst: dict[int, list[tuple[float, float]]] = {}
    dom_p99: list[float] = []
    for n, seen in enumerate(seen_per_page):
        first: dict[str, float] = {}
        in_dom: dict[str, float] = {}
        for identity, at, dom in seen:
            if identity in stamps and identity not in first:
                first[identity] = at
                in_dom[identity] = dom
        latencies = [first[i] - stamps[i] for i in first]
        dom_p99.append(
            quantile([in_dom[i] - stamps[i] for i in in_dom], 0.99) if in_dom else math.nan
        )
        start = min(stamps.values(), default=0.0)
        worst[n] = sorted(((first[i] - stamps[i], stamps[i] - start) for i in first), reverse=True)[
            :3
        ]
        label = f"page {n + 1}" + (" (big open)" if n == 0 else "")
        if latencies:
            rows.append(
                (
                    label,
                    len(first),
                    quantile(latencies, 0.5),
                    quantile(latencies, 0.99),
                    max(latencies),
                )
            )
        else:
            rows.append((label, 0, math.nan, math.nan, math.nan))
    costs = {
        "server: loop lag (10 ms)": _costs(server["loop lag"]),
        "server: sample": _costs(server["sample"]),
        "server: gc pause": _costs(server["gc"]),
        "server: build message": _costs(server["delta"]),
    }
    # Page entries: ["message", start, parsed, applied, bytes] and ["render", start, end].
    picks = {"page: parse": ("message", 1, 2), "page: apply": ("message", 2, 3)}
    picks["page: render frame"] = ("render", 1, 2)
    for name, (kind, begin, end) in picks.items():
        values = [e[end] - e[begin] for p in profiles for e in p or [] if e[0] == kind]
        costs[name] = _costs(values)
    busy = []
    for before, after in zip(metrics_before, metrics_after, strict=True):
        wall = after["Timestamp"] - before["Timestamp"]
        busy.append(
            {
                name: (after[name] - before[name]) / wall
                for name in (
                    "ScriptDuration",
                    "RecalcStyleDuration",
                    "LayoutDuration",
                    "TaskDuration",
                )
            }
        )
    delivered = [probe["first"][i] - stamps[i] for i in stamps if i in probe["first"]]
    bigs, smalls = probe["big"], probe["small"]
    per_big, per_small = probe["per"]
    return PagesResult(
        big=big,
        small=small,
        changes=churned,
        small_changes=churned // 2,
        first_render_ms=renders,
        pages=rows,
        slow_reads=len(slow_lags),
        slow_max_lag_ms=max(slow_lags, default=math.nan) * 1000.0,
        full_bytes=probe["full"],
        big_msgs=(len(bigs), sum(bigs) / max(1, len(bigs))),
        small_msgs=(len(smalls), sum(smalls) / max(1, len(smalls))),
        bytes_per_change=probe["bytes"] / max(1, k),
        per_instance=(
            sum(per_big) / max(1, len(per_big)),
            sum(per_small) / max(1, len(per_small)),
        ),
        one_change_max=probe["one"],
        big_part_bytes=big_part,
        costs=costs,
        busy=busy,
        server_cpu=server_cpu,
        worst=worst,
        dom_p99=dom_p99,
        delivered=(
            len(delivered),
            quantile(delivered, 0.5) if delivered else math.nan,
            quantile(delivered, 0.99) if delivered else math.nan,
            max(delivered, default=math.nan),
        ),
        calibration=calibration,
        load=(load_before, os.getloadavg()[0]),
    )


def print_pages(r: PagesResult, cfg: dict[str, Any]) -> None:
    frozen = ", gc frozen" if cfg.get("gc_freeze") else ""
    print(
        f"console pages: 1 service x {r.big} instances + {r.small} x {cfg['per_small']}, "
        f"{cfg['rate']} changes/s for {cfg['seconds']:g} s ({r.changes} changes, half to the "
        f"big service), interval {PAGES_INTERVAL * 1000:.0f} ms, {cfg['tabs']} Chromium browsers "
        f"+ 1 slow client, {cfg['hog']} CPU hogs{frozen}, "
        f"load average {r.load[0]:.1f} -> {r.load[1]:.1f}"
    )
    print(
        f"{'client':<18} {'first render ms':>16} {'changes seen':>13} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99 in DOM':>11}"
    )
    for n, (label, seen, p50, p99, worst) in enumerate(r.pages):
        print(
            f"{label:<18} {r.first_render_ms[n]:16.0f} {seen:>13} "
            f"{p50:8.1f} {p99:8.1f} {worst:8.1f} {r.dom_p99[n]:11.1f}"
        )
    seen, p50, p99, worst = r.delivered
    print(f"{'probe (WebSocket)':<18} {'':>16} {seen:>13} {p50:8.1f} {p99:8.1f} {worst:8.1f}")
    print(
        f"slow client: {r.slow_reads} reads (one per {cfg['slow_period']:g} s), "
        "newest sample at most "
        f"{r.slow_max_lag_ms:.0f} ms old when read (interval {PAGES_INTERVAL * 1000:.0f} ms)"
    )
    print(
        f"bytes: full state {r.full_bytes}; deltas with a big-service change {r.big_msgs[1]:.0f} "
        f"({r.big_msgs[0]} msgs; the big service's ids+hosts alone {r.big_part_bytes}); "
        f"deltas of small services only {r.small_msgs[1]:.0f} ({r.small_msgs[0]} msgs); "
        f"per change {r.bytes_per_change:.0f}"
    )
    print(
        f"bytes per changed instance: big service {r.per_instance[0]:.0f}, small services "
        f"{r.per_instance[1]:.0f}; largest one-instance delta {r.one_change_max}"
    )
    print(f"{'changed at once':<24} {'bytes':>7} {'msgs':>5} {'bytes/instance':>15}")
    for svc, n, size, msgs in r.calibration:
        label = f"{n} in {'the big service' if svc == 'big' else 'a small one'}"
        print(f"{label:<24} {size:>7} {msgs:>5} {size / n:15.0f}")
    print(
        f"{'page main thread':<18} {'script':>7} {'style':>7} {'layout':>7} {'all tasks':>10}"
        "  (share of wall time while the changes ran)"
    )
    for n, b in enumerate(r.busy):
        print(
            f"{'page ' + str(n + 1):<18} {b['ScriptDuration']:7.1%} "
            f"{b['RecalcStyleDuration']:7.1%} {b['LayoutDuration']:7.1%} {b['TaskDuration']:10.1%}"
        )
    for n, slowest in r.worst.items():
        said = ", ".join(f"{ms:.0f} ms at +{at / 1000:.1f} s" for ms, at in slowest)
        print(f"page {n + 1} slowest changes: {said}")
    print(
        f"owner process (owner, console, server, probe and slow client): "
        f"{r.server_cpu:.1%} of a core while the changes ran"
    )
    print(f"{'where the time goes':<24} {'calls':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, (calls, p50, p99, most) in r.costs.items():
        print(f"{name:<24} {calls:>7} {p50:8.2f} {p99:8.2f} {most:8.2f}")


def run_pages(
    *, smoke: bool = False, seconds: float | None = None, hog: int = 0, gc_freeze: bool = False
) -> tuple[PagesResult, dict[str, Any]]:
    """The page scenario: (result, the configuration it ran with)."""
    import tempfile

    cfg = dict(PAGES_SMOKE if smoke else PAGES_FULL)
    if seconds:
        cfg["seconds"] = seconds
    cfg["hog"] = hog
    cfg["gc_freeze"] = gc_freeze
    with tempfile.TemporaryDirectory() as profile:
        result = trio.run(_pages_main, cfg, profile)
    print_pages(result, cfg)
    return result, cfg


def main(argv: list[str] | None = None) -> Result | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a small, short run")
    parser.add_argument("--clients", type=int, help="override the number of clients")
    parser.add_argument("--seconds", type=float, help="override the change window")
    parser.add_argument(
        "--pages",
        action="store_true",
        help="the page scenario: one 1,000-instance service, 20 small ones, Chromium browsers",
    )
    parser.add_argument(
        "--hog", type=int, default=0, help="CPU-bound processes run beside (--pages)"
    )
    parser.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() once set up (--pages)"
    )
    parser.add_argument("--child", nargs=2, metavar=("URL", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        trio.run(_child_main, args.child[0], json.loads(args.child[1]))
        return None
    if args.pages:
        run_pages(smoke=args.smoke, seconds=args.seconds, hog=args.hog, gc_freeze=args.gc_freeze)
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
