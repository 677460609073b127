"""Decoding a large Consul health answer, and what applying it costs the event loop.

Two measurements on one ``/v1/health/service/<name>`` answer of N instances
(documented shape: Node, Service with Weights/Tags/Meta, serfHealth + service
check per entry):

1. Decode time: ``json.loads`` of the bytes alone (what a thin client hands
   its users before any work); the minimal-msgspec floor: the same bytes into
   minimal msgspec structs of exactly the fields the listing uses (node name,
   address and meta; service id, address, port, weights, tags and meta;
   check statuses) plus one plain walk building the same ``Instance``
   objects and the same ``ProviderSnapshot`` (health aggregation, the node
   meta zone fallback, tags and meta shared per distinct value; nothing
   else validated); and that decode alone (nothing built, for information).
   Against them the provider's decoder (parsing + validation + typed
   ``Instance`` objects + the ``ProviderSnapshot``), both the one-call
   decoder and the cooperative one the watch loop uses for large bodies.
   Each round times every contender best-of-several, interleaved repeat by
   repeat in the same process, and takes the ratio within the round.
   Targets: the decode costs at most 1.2x the floor and at most 0.5x
   ``json.loads``. The median round is the headline; the worst round is
   printed beside it. The load average is printed with the table.
2. Event-loop stall: a ticker task records its worst lateness while the
   provider's watch loop receives updates of that size and publishes them
   (the body is cut into raw elements in one short pass, then decoded in
   ~2 ms slices with checkpoints in between), compared with decoding the
   same bytes inline on the loop. Target: no stall above 25 ms. The median
   of the per-round worst stalls is the headline; the worst round (the
   single largest stall seen) is printed too.

Run ``python -m benchmarks.consul_decode [--smoke]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial
from types import MappingProxyType
from typing import Any, NamedTuple

import httpx
import msgspec
import trio
from nadisc_consul import ConsulProvider, ConsulSettings, decode_health_service
from nadisc_consul._wire import decode_health_service_cooperatively

from nadisc import ConnectionContext, EvidenceKind, Instance, ProviderFailure, ProviderSnapshot


def health_answer(instances: int) -> bytes:
    """A health/service answer with ``instances`` passing entries on 64 nodes."""
    entries: list[dict[str, Any]] = []
    for i in range(instances):
        node = f"node-{i % 64:02}"
        address = f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"
        entries.append(
            {
                "Node": {
                    "ID": f"6f1b5c3a-0000-4000-8000-{i % 64:012}",
                    "Node": node,
                    "Address": f"10.200.0.{i % 64}",
                    "Datacenter": "dc1",
                    "TaggedAddresses": {"lan": f"10.200.0.{i % 64}", "wan": f"10.200.0.{i % 64}"},
                    "Meta": {"consul-network-segment": ""},
                    "CreateIndex": 5,
                    "ModifyIndex": 5,
                },
                "Service": {
                    "ID": f"orders-{i}",
                    "Service": "orders",
                    "Tags": ["grpc", "v2"],
                    "Address": address,
                    "TaggedAddresses": {"lan_ipv4": {"Address": address, "Port": 8080}},
                    "Meta": {"nadisc-version": "0.1.0", "nadisc-cluster": "cluster-1"},
                    "Port": 8080,
                    "Weights": {"Passing": 1 + i % 3, "Warning": 1},
                    "EnableTagOverride": False,
                    "CreateIndex": 10 + i,
                    "ModifyIndex": 10 + i,
                },
                "Checks": [
                    {
                        "Node": node,
                        "CheckID": "serfHealth",
                        "Name": "Serf Health Status",
                        "Status": "passing",
                        "Notes": "",
                        "Output": "Agent alive and reachable",
                        "ServiceID": "",
                        "ServiceName": "",
                        "ServiceTags": [],
                        "Type": "",
                        "CreateIndex": 5,
                        "ModifyIndex": 5,
                    },
                    {
                        "Node": node,
                        "CheckID": f"service:orders-{i}",
                        "Name": "orders health",
                        "Status": "passing",
                        "Notes": "",
                        "Output": "HTTP GET http://x/health: 200 OK",
                        "ServiceID": f"orders-{i}",
                        "ServiceName": "orders",
                        "ServiceTags": ["grpc", "v2"],
                        "Type": "http",
                        "CreateIndex": 10 + i,
                        "ModifyIndex": 10 + i,
                    },
                ],
            }
        )
    return json.dumps(entries).encode()


def best_of(repeats: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


class _Sink:
    def __init__(self) -> None:
        self.published = 0
        self.moved = trio.Event()

    def publish(self, snapshot: ProviderSnapshot) -> None:
        self.published += 1
        self.moved.set()

    def fail(self, failure: ProviderFailure) -> None:
        raise failure

    def refresh(self) -> None:
        pass


async def _ticker(lateness: list[float], period: float = 0.001) -> None:
    while True:
        expected = trio.current_time() + period
        await trio.sleep(period)
        lateness.append(trio.current_time() - expected)


class StallRound(NamedTuple):
    """One round of updates through the watch loop (seconds)."""

    #: worst ticker lateness: what another task on the loop experienced
    stall: float
    #: longest single task step with the collector's pauses taken out: how
    #: long our own code held the loop at a stretch
    step: float
    #: longest pause of Python's cyclic garbage collector in the round
    collector: float


class _LoopWatch(trio.abc.Instrument):
    """Times every task step and every garbage-collector pause."""

    def __init__(self) -> None:
        self.step_started = 0.0
        self.pause_started = 0.0
        self.paused = 0.0
        self.paused_at_step = 0.0
        self.longest_step = 0.0
        self.longest_pause = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.step_started = time.perf_counter()
        self.paused_at_step = self.paused

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        held = time.perf_counter() - self.step_started - (self.paused - self.paused_at_step)
        self.longest_step = max(self.longest_step, held)

    def collector(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.pause_started = time.perf_counter()
            return
        pause = time.perf_counter() - self.pause_started
        self.paused += pause
        self.longest_pause = max(self.longest_pause, pause)

    def reset(self) -> None:
        self.longest_step = self.longest_pause = 0.0


async def watch_stall(body: bytes, instances: int, updates: int) -> StallRound:
    """Stalls while the provider's watch loop applies ``updates`` answers."""
    index = [1]
    release = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal release
        if "index" in request.url.params:
            await release.wait()
            release = trio.Event()
            index[0] += 1
        return httpx.Response(200, content=body, headers={"X-Consul-Index": str(index[0])})

    provider = ConsulProvider(
        ConnectionContext("bench", 5.0, instances, len(body) + 1),
        ConsulSettings(watch_rate=1000, watch_burst=1000),
        transport=httpx.MockTransport(handler),
    )
    sink = _Sink()
    lateness: list[float] = []
    watch = _LoopWatch()
    trio.lowlevel.add_instrument(watch)
    gc.callbacks.append(watch.collector)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.watch, "orders", sink)
            nursery.start_soon(_ticker, lateness)
            await trio.sleep(0.05)
            lateness.clear()
            watch.reset()
            for _ in range(updates):
                sink.moved = trio.Event()
                release.set()
                await sink.moved.wait()
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    finally:
        gc.callbacks.remove(watch.collector)
        trio.lowlevel.remove_instrument(watch)
    await provider.aclose()
    return StallRound(max(lateness), watch.longest_step, watch.longest_pause)


async def reuse_stall(body: bytes, instances: int, updates: int) -> StallRound:
    """Stalls while a loop applies ``updates`` answers with the cooperative
    decoder, handing it the previous snapshot (unchanged instances reused)."""
    lateness: list[float] = []
    watch = _LoopWatch()
    trio.lowlevel.add_instrument(watch)
    gc.callbacks.append(watch.collector)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_ticker, lateness)
            snapshot = await decode_health_service_cooperatively(
                body, service="orders", max_instances=instances
            )
            await trio.sleep(0.05)
            lateness.clear()
            watch.reset()
            for _ in range(updates):
                snapshot = await decode_health_service_cooperatively(
                    body, service="orders", max_instances=instances, previous=snapshot
                )
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    finally:
        gc.callbacks.remove(watch.collector)
        trio.lowlevel.remove_instrument(watch)
    return StallRound(max(lateness), watch.longest_step, watch.longest_pause)


async def inline_stall(body: bytes, instances: int, updates: int) -> float:
    """The same, decoding on the event loop itself (what offloading avoids)."""
    lateness: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_ticker, lateness)
        await trio.sleep(0.05)
        lateness.clear()
        for _ in range(updates):
            decode_health_service(body, service="orders", max_instances=instances)
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    return max(lateness)


# The floor: what a thin msgspec client does with the same body. The
# structs hold exactly the fields the listing uses, typed as plain values;
# the walk builds the same Instance objects and snapshot the provider does
# (all checks passing, node meta zone when the service declares none, one
# shared tags tuple and meta view per distinct value) and validates nothing
# beyond the types and what Instance's own constructor checks.


class _FloorNode(msgspec.Struct, gc=False):
    Node: str
    Address: str = ""
    Meta: dict[str, str] | None = None


class _FloorWeights(msgspec.Struct, gc=False):
    Passing: int = 1


class _FloorService(msgspec.Struct, gc=False):
    ID: str
    Address: str = ""
    Port: int = 0
    Weights: _FloorWeights | None = None
    Tags: list[str] | None = None
    Meta: dict[str, str] | None = None


class _FloorCheck(msgspec.Struct, gc=False):
    Status: str


class _FloorEntry(msgspec.Struct, gc=False):
    Node: _FloorNode
    Service: _FloorService
    Checks: list[_FloorCheck] | None = None


_floor = msgspec.json.Decoder(list[_FloorEntry])


def floor_listing(body: bytes, service: str) -> ProviderSnapshot:
    """The minimal honest listing: the floor structs and one walk building
    the same instances (see above)."""
    shared_tags: dict[tuple[str, ...], tuple[str, ...]] = {}
    shared_meta: dict[tuple[tuple[str, str], ...], MappingProxyType[str, str]] = {}
    instances = []
    for entry in _floor.decode(body):
        checks = entry.Checks
        if checks and any(check.Status != "passing" for check in checks):
            continue
        svc, node = entry.Service, entry.Node
        tags = tuple(svc.Tags) if svc.Tags else ()
        tags = shared_tags.setdefault(tags, tags)
        meta = svc.Meta or {}
        zone = node.Meta.get("zone") if node.Meta else None
        if zone and "zone" not in meta:
            meta = {**meta, "zone": zone}
        key = tuple(meta.items())
        view = shared_meta.get(key)
        if view is None:
            view = shared_meta[key] = MappingProxyType(meta)
        weight = float(svc.Weights.Passing) if svc.Weights is not None else 1.0
        host = svc.Address or node.Address
        instances.append(Instance(svc.ID, host, svc.Port, weight, view, tags))
    return ProviderSnapshot(service, tuple(instances), EvidenceKind.REGISTRY_HEALTH)


async def decode_round(
    body: bytes, instances: int, repeats: int
) -> tuple[float, float, float, float, float]:
    """One round: best ``json.loads``, one-call decode, cooperative decode,
    the floor's decode alone and the floor with its walk (CPU seconds).

    The five are interleaved repeat by repeat, on a running event loop, so
    a burst of load from elsewhere on the machine hits all of them alike.
    Each timed call follows an untimed call of the same contender, so each
    runs in its own steady state: a call right after ``json.loads`` would
    run on the allocator and collector state its freed objects leave, and
    be charged for them. CPU time of the process, so time the scheduler
    gives to other processes is not counted.
    """
    best = [float("inf")] * 5
    clock = time.process_time

    def one_call() -> object:
        return decode_health_service(body, service="orders", max_instances=instances)

    def cooperative() -> Awaitable[object]:
        return decode_health_service_cooperatively(body, service="orders", max_instances=instances)

    calls: list[Callable[[], object]] = [
        partial(json.loads, body),
        one_call,
        cooperative,
        partial(_floor.decode, body),
        partial(floor_listing, body, "orders"),
    ]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            for timed in (False, True):
                start = clock()
                result = call()
                if isinstance(result, Awaitable):
                    await result
                if timed:
                    best[i] = min(best[i], clock() - start)
    return best[0], best[1], best[2], best[3], best[4]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small and quick")
    args = parser.parse_args(argv)
    instances = 512 if args.smoke else 4096
    repeats = 3 if args.smoke else 7
    rounds = 2 if args.smoke else 5
    updates = 2 if args.smoke else 8
    body = health_answer(instances)

    snapshot = decode_health_service(body, service="orders", max_instances=instances)
    assert len(snapshot.instances) == instances
    cooperative_snapshot = trio.run(
        partial(
            decode_health_service_cooperatively, body, service="orders", max_instances=instances
        )
    )
    assert cooperative_snapshot == snapshot
    assert floor_listing(body, "orders") == snapshot  # the floor builds the same listing

    timings = [trio.run(decode_round, body, instances, repeats) for _ in range(rounds)]
    ratios = sorted(t[1] / t[0] for t in timings)
    cooperative_ratios = sorted(t[2] / t[0] for t in timings)
    floor_ratios = sorted(t[1] / t[4] for t in timings)
    cooperative_floor_ratios = sorted(t[2] / t[4] for t in timings)
    decode_only_ratios = sorted(t[1] / t[3] for t in timings)
    floor_loads_ratios = sorted(t[4] / t[0] for t in timings)
    loads = statistics.median(t[0] for t in timings)
    decode = statistics.median(t[1] for t in timings)
    cooperative = statistics.median(t[2] for t in timings)
    floor_decode = statistics.median(t[3] for t in timings)
    floor = statistics.median(t[4] for t in timings)
    load_average = os.getloadavg()
    again = best_of(
        repeats,
        partial(
            decode_health_service,
            body,
            service="orders",
            max_instances=instances,
            previous=snapshot,
        ),
    )
    # The stall rounds measure the collector too: hold no extra snapshots.
    del snapshot, cooperative_snapshot

    watched = sorted(trio.run(watch_stall, body, instances, updates) for _ in range(rounds))
    stall = statistics.median(r.stall for r in watched)
    worst = watched[-1]
    inline = trio.run(inline_stall, body, instances, updates)
    reused = sorted(trio.run(reuse_stall, body, instances, updates) for _ in range(rounds))
    # Services often call gc.freeze() once after start-up, which takes the
    # start-up objects out of every later full collection. Measured last:
    # freezing is process-wide.
    gc.collect()
    gc.freeze()
    try:
        frozen = sorted(trio.run(watch_stall, body, instances, updates) for _ in range(rounds))
    finally:
        gc.unfreeze()

    rows = [
        ("instances", f"{instances}", ""),
        ("body", f"{len(body) / 1024:.0f} KiB", ""),
        ("json.loads", f"{loads * 1000:.2f} ms", "CPU time, median round, best of each"),
        ("minimal msgspec + same walk (floor)", f"{floor * 1000:.2f} ms", "same Instances"),
        ("  floor / json.loads (median)", f"{statistics.median(floor_loads_ratios):.2f}x", ""),
        ("minimal msgspec structs alone", f"{floor_decode * 1000:.2f} ms", "nothing built"),
        ("decode to typed snapshot", f"{decode * 1000:.2f} ms", "validate + Instance + snapshot"),
        ("  / floor (median)", f"{statistics.median(floor_ratios):.2f}x", "target <= 1.20x"),
        ("  / floor (worst round)", f"{floor_ratios[-1]:.2f}x", f"of {rounds} rounds"),
        (
            "  / structs alone (median)",
            f"{statistics.median(decode_only_ratios):.2f}x",
            "for information",
        ),
        ("  / json.loads (median)", f"{statistics.median(ratios):.2f}x", "target <= 0.50x"),
        ("  / json.loads (worst round)", f"{ratios[-1]:.2f}x", f"of {rounds} rounds"),
        ("cooperative decode (watch path)", f"{cooperative * 1000:.2f} ms", "2 ms slices"),
        ("  / floor (median)", f"{statistics.median(cooperative_floor_ratios):.2f}x", ""),
        ("  / json.loads (median)", f"{statistics.median(cooperative_ratios):.2f}x", ""),
        ("  / json.loads (worst round)", f"{cooperative_ratios[-1]:.2f}x", ""),
        ("max loop stall, watch loop (median)", f"{stall * 1000:.2f} ms", "target <= 25 ms"),
        ("  worst round", f"{worst.stall * 1000:.2f} ms", f"of {rounds} x {updates} updates"),
        (
            "  longest step, gc excluded",
            f"{max(r.step for r in watched) * 1000:.2f} ms",
            "all rounds",
        ),
        ("  longest gc pause", f"{max(r.collector for r in watched) * 1000:.2f} ms", "all rounds"),
        (
            "  after gc.freeze() (median)",
            f"{statistics.median(r.stall for r in frozen) * 1000:.2f} ms",
            "",
        ),
        ("  after gc.freeze(), worst", f"{frozen[-1].stall * 1000:.2f} ms", ""),
        ("max loop stall, inline decode", f"{inline * 1000:.2f} ms", "for comparison"),
        ("decode, previous snapshot given", f"{again * 1000:.2f} ms", "unchanged: reused"),
        (
            "max loop stall, reusing (median)",
            f"{statistics.median(r.stall for r in reused) * 1000:.2f} ms",
            "cooperative + previous",
        ),
        ("  worst round", f"{reused[-1].stall * 1000:.2f} ms", ""),
        ("  longest gc pause", f"{max(r.collector for r in reused) * 1000:.2f} ms", ""),
        ("load average (1, 5, 15 min)", " ".join(f"{v:.2f}" for v in load_average), ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'consul health decode':<{width}}  {'value':>12}  note")
    print("-" * (width + 32))
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>12}  {note}")
    return {
        "loads": loads,
        "decode": decode,
        "floor": floor,
        "floor_decode": floor_decode,
        "floor_ratio": statistics.median(floor_ratios),
        "worst_floor_ratio": floor_ratios[-1],
        "decode_only_ratio": statistics.median(decode_only_ratios),
        "floor_loads_ratio": statistics.median(floor_loads_ratios),
        "load_average": load_average,
        "cooperative_floor_ratio": statistics.median(cooperative_floor_ratios),
        "ratio": statistics.median(ratios),
        "worst_ratio": ratios[-1],
        "cooperative": cooperative,
        "cooperative_ratio": statistics.median(cooperative_ratios),
        "worst_cooperative_ratio": cooperative_ratios[-1],
        "stall": stall,
        "worst_stall": worst.stall,
        "longest_step": max(r.step for r in watched),
        "longest_gc_pause": max(r.collector for r in watched),
        "frozen_worst_stall": frozen[-1].stall,
        "reused_decode": again,
        "reused_worst_stall": reused[-1].stall,
        "inline_stall": inline,
    }


if __name__ == "__main__":
    main()
