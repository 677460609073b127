"""The runtime at its limits, against a real etcd on loopback.

The experiments:

* **registrations**: one owner opened with ``open_discovery`` on a config
  carrying N startup-required registrations (defaults: 1,000 with the
  default limits, ``max_parallel_operations`` 4; then 10,000 with raised
  limits). Measured: the time until entry returned (every registration
  Active), the process CPU while the 1,000 sit idle for 30 s (renewals and
  checks only; they share leases), the close report (how many were
  deregistered) and what the server still holds afterwards (keys under the
  prefix, leases).
* (one throw-away etcd, started by this script, serves every scenario;
  each uses services of its own)
* **watches**: one owner observes 1,000 services (one instance each, the
  gRPC resolver layout). For 60 s a 5 ms ticker measures event-loop lag;
  twice a second another process's put (a plain HTTP client) adds an
  instance to a random service and the time until that observation lists it
  is taken. RSS is sampled after warm-up and at the end.
* **watches-idle**: the same 1,000 watched services with nothing changing
  for 30 s: the process CPU and the owner's re-reads (a live, current watch
  needs none).
* **burst**: a writer in another process puts 10,000 distinct keys of one
  watched service as fast as etcd takes them (32 concurrent writers). The
  time from its last acknowledged put until the observation lists all
  10,000, the longest loop stall during the run and the RSS growth. Run
  twice: with ``gc.freeze()`` once the owner is up (what a long-running host
  does, ``open_host(freeze_heap=True)``), and without it, where every full
  collection also walks the import-time heap; the cost of one full
  collection of the heap before the burst is printed (the floor of any
  unfrozen one on this machine).
* **rewrites**: 100 keys rewritten 100 times by the other process; the time
  from the last acknowledged put until the observation shows every key's
  last value.

Targets (from the issue): loop lag p99 <= 50 ms and put seen p99 <= 100 ms
over 1,000 watches; a 10,000-key burst complete <= 5 s after the last ack
with no stall > 25 ms; 100 x 100 rewrites final <= 150 ms. The machine this
runs on may be shared: the table prints what was measured.

Run: ``python -m benchmarks.runtime_scale [--smoke] [--only NAME]``
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.etcd_latency import EtcdProcess, nearest_rank
from nadisc import (
    CloseOutcome,
    DiscoveryConfig,
    Eligibility,
    EvidenceUnavailable,
    Observation,
    open_discovery,
)


@dataclass(frozen=True)
class Sizes:
    registrations: int
    raised_registrations: int
    watches: int
    watch_seconds: float
    burst: int
    rewrite_keys: int
    rewrite_rounds: int


FULL = Sizes(1000, 10_000, 1000, 60.0, 10_000, 100, 100)
SMOKE = Sizes(30, 60, 20, 1.0, 200, 10, 3)


@dataclass
class Row:
    scenario: str
    measured: str
    target: str
    ok: bool
    values: dict[str, float] = field(default_factory=dict)


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class LoopLag:
    """Event-loop lag seen by a 5 ms ticker (and RSS, every 100 ms)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.peak_rss = rss_mb()

    def reset(self) -> None:
        self.samples.clear()
        self.peak_rss = rss_mb()

    @property
    def longest(self) -> float:
        return max(self.samples, default=0.0)

    async def run(self) -> None:
        ticks = 0
        while True:
            start = time.perf_counter()
            await trio.sleep(0.005)
            self.samples.append(max(0.0, time.perf_counter() - start - 0.005))
            ticks += 1
            if ticks % 20 == 0:
                self.peak_rss = max(self.peak_rss, rss_mb())


class GcClock:
    """CPU time spent in the cyclic garbage collector (a ``gc.callbacks`` hook)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.total += time.thread_time() - self._start


class StepClock(trio.abc.Instrument):
    """The longest single task step, in CPU time of this thread: what our own
    code held the loop for, without the time the OS gave other processes
    (the wall-clock lag above includes both on a shared machine). Also the
    longest step net of the cyclic GC's collections that ran inside it (the
    interpreter's cost of the heap, not our code's)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.longest_net = 0.0
        self.task = ""
        #: Steps over 25 ms CPU, by task name.
        self.over: dict[str, int] = {}
        self._gc = GcClock()
        self._started: tuple[trio.lowlevel.Task, float, float] | None = None

    def reset(self) -> None:
        self.longest = 0.0
        self.longest_net = 0.0
        self.task = ""
        self.over = {}
        self._started = None

    def attach(self) -> None:
        """Add as a trio instrument (and hook the GC clock)."""
        gc.callbacks.append(self._gc)
        trio.lowlevel.add_instrument(self)

    def detach(self) -> None:
        trio.lowlevel.remove_instrument(self)
        gc.callbacks.remove(self._gc)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._started = (task, time.thread_time(), self._gc.total)

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        started = self._started
        self._started = None
        if started is None or started[0] is not task:
            return  # added or reset in the middle of this step
        took = time.thread_time() - started[1]
        net = took - (self._gc.total - started[2])
        if took > 0.025:
            self.over[task.name] = self.over.get(task.name, 0) + 1
        if took > self.longest:
            self.longest = took
            self.task = task.name
        self.longest_net = max(self.longest_net, net)


@contextmanager
def step_clock() -> Iterator[StepClock]:
    clock = StepClock()
    clock.attach()
    try:
        yield clock
    finally:
        clock.detach()


async def settle_heap(*, freeze: bool) -> tuple[float, int]:
    """One full collection of the heap as it stands (imports, the owner, its
    observations), then ``gc.freeze()`` if asked, as
    ``open_host(freeze_heap=True)`` does once running. Returns what that
    collection cost (ms) and the objects it left: the floor of any unfrozen
    full collection later. Sleeps one tick afterwards, so that the ticker's
    sample delayed by the collection lands before a measuring window opens."""
    collected = time.perf_counter()
    gc.collect()
    took = (time.perf_counter() - collected) * 1e3
    objects = len(gc.get_objects())
    if freeze:
        gc.freeze()
    await trio.sleep(0.05)
    return took, objects


def config(url: str, services: Sequence[str], **extra: Any) -> DiscoveryConfig:
    etcd: dict[str, Any] = {
        "endpoints": [url],
        "prefix": "bench",
        "services": {name: {"name": name} for name in services},
    }
    etcd.update(extra.pop("etcd", {}))
    primary: dict[str, Any] = {"provider": "etcd", "request_timeout_ms": 3000, "etcd": etcd}
    primary.update(extra.pop("connection", {}))
    document: dict[str, Any] = {"enabled": True, "connections": {"primary": primary}}
    document.update(extra)
    return DiscoveryConfig.model_validate(document)


async def count_keys(http: httpx.AsyncClient, url: str, prefix: str) -> int:
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    answer = await http.post(
        f"{url}/v3/kv/range",
        json={"key": b64(prefix), "range_end": b64(end), "count_only": True},
    )
    return int(answer.json().get("count", 0))


async def count_leases(http: httpx.AsyncClient, url: str) -> int:
    answer = await http.post(f"{url}/v3/lease/leases", json={})
    return len(answer.json().get("leases", []))


# --------------------------------------------------------------------- registrations


async def registrations(url: str, count: int, *, raised: bool, idle: float = 0.0) -> Row:
    """``idle``: seconds the Active registrations are left alone before the
    close, their process CPU measured (renewals and checks only)."""
    names = [f"r{n:05d}" for n in range(count)]
    plan = {
        name: {
            "service_name": "self",
            "ip": f"10.{n // 62500}.{n // 250 % 250}.{n % 250 + 1}",
            "port": 8080,
            "eligibility_ref": name,
        }
        for n, name in enumerate(names)
    }
    limits: dict[str, Any] = {"max_registrations": max(count, 64)}
    connection: dict[str, Any] = {"observation_grace_ms": 120_000}
    etcd: dict[str, Any] = {"ttl_seconds": 30}
    if raised:
        # What 10,000 registrations need: every registration costs 4 requests
        # to become Active (grant, put, and the confirming check's
        # time-to-live + range) and, while Active, a keepalive per
        # ttl_seconds / 3 plus a 2-request check per monitor interval. With a
        # 180 s TTL and a 60 s monitor interval that is 500 requests/s for
        # 10,000 registrations: at 3-4 ms of CPU per request (the table shows
        # the CPU per registration) that is 1.5-2 cores, more than one event
        # loop can give, so the queue never drains. A 30 min TTL
        # and a 10 min monitor interval bring the steady state to 50/s.
        limits["max_parallel_operations"] = 16
        connection.update(
            monitor_interval_ms=600_000,
            request_timeout_ms=10_000,
            observation_grace_ms=900_000,
            snapshot={"max_age_ms": 30_000, "stale_if_error_ms": 10_000},
        )
        etcd.update(ttl_seconds=1800, max_request_connections=16)
    cfg = config(
        url,
        ["self"],
        etcd=etcd,
        connection=connection,
        limits=limits,
        registrations=plan,
        shutdown_timeout_ms=600_000,
    )
    started, cpu_started = time.perf_counter(), time.process_time()
    async with open_discovery(
        cfg,
        eligibility={name: Eligibility.always() for name in names},
        prepare_deadline=trio.current_time() + 10,
        publish_deadline=trio.current_time() + 900,
    ) as owner:
        active = time.perf_counter() - started
        active_cpu = time.process_time() - cpu_started
        idle_share = 0.0
        if idle:
            await settle_heap(freeze=True)
            idle_cpu, idle_wall = time.process_time(), time.perf_counter()
            await trio.sleep(idle)
            idle_share = (time.process_time() - idle_cpu) / (time.perf_counter() - idle_wall)
            gc.unfreeze()
        closing, cpu_closing = time.perf_counter(), time.process_time()
    closed = time.perf_counter() - closing
    closed_cpu = time.process_time() - cpu_closing
    close_report = owner.close_report
    report = close_report.registrations if close_report is not None else ()
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        keys = await count_keys(http, url, "bench/self/")
        leases = await count_leases(http, url)
    deregistered = sum(
        1 for entry in report if getattr(entry, "outcome", None) is CloseOutcome.DEREGISTERED
    )
    label = f"{count:,} registrations" + (" (raised limits)" if raised else "")
    limits_text = (
        "parallel 16, ttl 1800 s, monitor 600 s, request timeout 10 s"
        if raised
        else "default limits (parallel 4)"
    )
    idle_text = f"idle {idle:g} s: process CPU {idle_share:.1%} of a core; " if idle else ""
    return Row(
        label,
        f"all Active in {active:.2f} s ({active_cpu / count * 1e3:.1f} ms CPU each); {idle_text}"
        f"{deregistered:,}/{count:,} deregistered at close in {closed:.2f} s "
        f"({closed_cpu / count * 1e3:.1f} ms CPU each); {keys} keys, {leases} leases left "
        f"[{limits_text}]",
        "all Active, all deregistered, 0 keys, 0 leases"
        + (", idle <= 10% of a core" if idle else ""),
        deregistered == count and keys == 0 and leases == 0 and idle_share <= 0.10,
        {
            "active_s": active,
            "close_s": closed,
            "keys": keys,
            "leases": leases,
            "idle_cpu_share": idle_share,
        },
    )


# --------------------------------------------------------------------------- watches


def _listed(observation: Observation, identity: str) -> bool:
    try:
        return identity in observation.snapshot().identities()
    except EvidenceUnavailable:
        return False


class GcPauses:
    """The longest cyclic-GC pause (wall) while installed."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.longest = max(self.longest, time.perf_counter() - self._start)


async def watches(
    url: str, count: int, seconds: float, poll_ms: int = 5000, *, freeze: bool = True
) -> Row:
    """``freeze``: ``gc.freeze()`` after warm-up, what a host holding
    thousands of long-lived tasks does so that the cyclic GC's full
    collections stop rescanning them (the unfrozen variant shows why)."""
    services = [f"w{n:04d}" for n in range(count)]
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:

        async def put(service: str, identity: str, n: int) -> None:
            value = json.dumps({"Op": 0, "Addr": f"10.7.{n // 250 % 250}.{n % 250 + 1}:80"})
            answer = await http.post(
                f"{url}/v3/kv/put",
                json={"key": b64(f"bench/{service}/{identity}"), "value": b64(value)},
            )
            answer.raise_for_status()

        for n, service in enumerate(services):
            await put(service, "i0", n)
        # prepare ranges every bound service (a count-only read each) within
        # one request timeout: give it room on a busy machine.
        cfg = config(
            url,
            services,
            limits={"max_watch_streams": count},
            connection={
                "request_timeout_ms": 10_000,
                "poll_interval_ms": poll_ms,
                "observation_grace_ms": 30_000,
                "snapshot": {"max_age_ms": poll_ms + 25_000, "stale_if_error_ms": 10_000},
            },
        )
        lag = LoopLag()
        steps = StepClock()
        seen_ms: list[float] = []
        # prepare checks read permission on every bound service: one small
        # range each, one after another.
        async with open_discovery(cfg, prepare_deadline=trio.current_time() + 300) as owner:
            client = owner.client()
            observations = {s: await client.observe(s, trio.current_time() + 60) for s in services}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lag.run)
                await trio.sleep(min(5.0, seconds / 4))  # warm-up
                if freeze:
                    await settle_heap(freeze=True)
                lag.reset()
                steps.reset()
                steps.attach()
                rss_start = rss_mb()
                cpu_start, wall_start = time.process_time(), time.perf_counter()
                pauses = GcPauses()
                gc.callbacks.append(pauses)
                end = time.perf_counter() + seconds
                rng = random.Random(7)
                n = 0
                while time.perf_counter() < end:
                    n += 1
                    service = rng.choice(services)
                    identity = f"p{n:05d}"
                    observation = observations[service]
                    began = time.perf_counter()
                    await put(service, identity, n)
                    while not _listed(observation, identity):
                        await observation.changed(trio.current_time() + 5)
                    seen_ms.append((time.perf_counter() - began) * 1e3)
                    await trio.sleep(0.5)
                rss_end = rss_mb()
                cpu_share = (time.process_time() - cpu_start) / (time.perf_counter() - wall_start)
                gc.callbacks.remove(pauses)
                if freeze:
                    gc.unfreeze()
                steps.detach()
                stream_count = owner.observer().snapshot().capacity.watch_streams
                nursery.cancel_scope.cancel()
    lag_p99 = nearest_rank(lag.samples, 0.99) * 1e3
    seen_p99 = nearest_rank(seen_ms, 0.99)
    growth = rss_end - rss_start
    over = sum(steps.over.values())
    return Row(
        f"{count:,} watched services (poll {poll_ms / 1000:g} s"
        + (", gc.freeze)" if freeze else ", no gc.freeze)"),
        f"{stream_count} watch stream(s); loop lag p99 {lag_p99:.1f} ms (max "
        f"{lag.longest * 1e3:.1f}) wall; longest task step {steps.longest * 1e3:.1f} ms CPU "
        f"({over} over 25 ms; {steps.longest_net * 1e3:.1f} ms net of GC), longest GC pause "
        f"{pauses.longest * 1e3:.1f} ms wall; process CPU "
        f"{cpu_share:.0%} of a core over {seconds:g} s; put seen p50 "
        f"{nearest_rank(seen_ms, 0.5):.1f} / p99 {seen_p99:.1f} ms ({len(seen_ms)} puts); "
        f"RSS {rss_start:.0f} -> {rss_end:.0f} MB",
        "lag p99 <= 50 ms, seen p99 <= 100 ms, RSS flat",
        lag_p99 <= 50 and seen_p99 <= 100 and growth < 0.1 * rss_start + 10,
        {
            "lag_p99_ms": lag_p99,
            "seen_p99_ms": seen_p99,
            "rss_growth_mb": growth,
            "streams": stream_count,
        },
    )


async def watches_idle(url: str, count: int, seconds: float, poll_ms: int = 5000) -> Row:
    """1,000 watched services and nothing changing: what the owner costs at
    rest. The watch's probe confirms every member every ``probe_interval_ms``
    (5 s), so no slot needs its confirmation re-read; the owner's queries
    over the window are counted beside the process CPU."""
    services = [f"idle{n:04d}" for n in range(count)]
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        for n, service in enumerate(services):
            value = json.dumps({"Op": 0, "Addr": f"10.8.{n // 250 % 250}.{n % 250 + 1}:80"})
            answer = await http.post(
                f"{url}/v3/kv/put",
                json={"key": b64(f"bench/{service}/i0"), "value": b64(value)},
            )
            answer.raise_for_status()
    cfg = config(
        url,
        services,
        limits={"max_watch_streams": count},
        connection={
            "request_timeout_ms": 10_000,
            "poll_interval_ms": poll_ms,
            "observation_grace_ms": 30_000,
            "snapshot": {"max_age_ms": poll_ms + 25_000, "stale_if_error_ms": 10_000},
        },
    )
    async with open_discovery(cfg, prepare_deadline=trio.current_time() + 300) as owner:
        client = owner.client()
        observations = [await client.observe(s, trio.current_time() + 60) for s in services]
        await trio.sleep(min(5.0, seconds / 4))  # warm-up
        await settle_heap(freeze=True)
        before = owner.observer().snapshot().connection("primary").queries
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        await trio.sleep(seconds)
        cpu_share = (time.process_time() - cpu_start) / (time.perf_counter() - wall_start)
        queries = owner.observer().snapshot().connection("primary").queries - before
        usable = sum(1 for o in observations if _listed(o, "i0"))
        gc.unfreeze()
    return Row(
        f"{count:,} watched services idle (poll {poll_ms / 1000:g} s)",
        f"process CPU {cpu_share:.1%} of a core over {seconds:g} s; {queries} owner "
        f"re-reads ({queries / seconds:.1f}/s); {usable}/{count} listings usable",
        "<= 10% of a core, every listing usable",
        cpu_share <= 0.10 and usable == count,
        {"cpu_share": cpu_share, "queries": queries},
    )


# ----------------------------------------------------------------- burst, rewrites

_WRITER = r"""
import base64, json, sys, time
import httpx, trio

url, prefix = sys.argv[1], sys.argv[2]
keys, rounds, workers = int(sys.argv[3]), int(sys.argv[4]), 32

def b64(text):
    return base64.b64encode(text.encode()).decode()

async def main():
    async with httpx.AsyncClient(timeout=30, trust_env=False,
                                 limits=httpx.Limits(max_connections=workers)) as http:
        for r in range(rounds):
            async def writer(w):
                for n in range(w, keys, workers):
                    addr = f"10.8.{n // 250 % 250}.{n % 250 + 1}:{r + 1}"
                    value = json.dumps({"Op": 0, "Addr": addr})
                    body = {"key": b64(f"{prefix}/k{n:05d}"), "value": b64(value)}
                    answer = await http.post(f"{url}/v3/kv/put", json=body)
                    answer.raise_for_status()
            async with trio.open_nursery() as nursery:
                for w in range(workers):
                    nursery.start_soon(writer, w)
    print(time.time(), flush=True)

trio.run(main)
"""


@dataclass
class Followed:
    #: Seconds from the writer's last acknowledged put to the final state seen.
    after: float
    lag: LoopLag
    rss_before: float
    #: Longest task step in CPU time (ms).
    step_ms: float
    #: Task steps over 25 ms CPU.
    steps_over: int = 0
    #: Longest task step net of GC collections inside it (ms CPU).
    step_net_ms: float = 0.0
    #: Longest cyclic-GC pause (ms, wall).
    gc_ms: float = 0.0
    #: One full collection of the heap before the window (ms), and its objects.
    heap_ms: float = 0.0
    heap_objects: int = 0


async def _follow_writer(
    url: str,
    service: str,
    keys: int,
    rounds: int,
    done: Callable[[Observation], bool],
    *,
    freeze: bool = True,
) -> Followed:
    """Run the writer process against a watched service until ``done``.
    ``freeze``: ``gc.freeze()`` once the owner is up, as a long-running host
    does (the unfrozen variant shows what the import-time heap costs)."""
    cfg = config(
        url,
        [service],
        limits={"max_instances_per_service": max(keys, 4096)},
        connection={"poll_interval_ms": 5000},
    )
    lag = LoopLag()
    async with open_discovery(cfg, prepare_deadline=trio.current_time() + 10) as owner:
        observation = await owner.client().observe(service, trio.current_time() + 10)
        with step_clock() as steps:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lag.run)
                await trio.sleep(0.5)
                heap_ms, heap_objects = await settle_heap(freeze=freeze)
                lag.reset()
                steps.reset()
                rss_before = rss_mb()
                pauses = GcPauses()
                gc.callbacks.append(pauses)
                command = [
                    sys.executable,
                    "-c",
                    _WRITER,
                    url,
                    f"bench/{service}",
                    str(keys),
                    str(rounds),
                ]
                process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
                assert process.stdout is not None
                acked = trio.Event()
                seen = 0.0

                async def watch_final() -> None:
                    # The moment the final state is first shown, once the
                    # writer has acknowledged its last put (judged afterwards).
                    nonlocal seen
                    while True:
                        if done(observation):
                            seen = time.time()
                            if acked.is_set():
                                return
                        await observation.changed(trio.current_time() + 900)

                output = b""
                with trio.fail_after(900):
                    async with trio.open_nursery() as inner:
                        inner.start_soon(watch_final)
                        while not output.endswith(b"\n"):
                            chunk = await process.stdout.receive_some()
                            if not chunk:
                                raise RuntimeError("the writer exited without reporting")
                            output += chunk
                        acked.set()
                        if done(observation):
                            inner.cancel_scope.cancel()
                    await process.wait()
                last_ack = float(output.decode().strip())
                gc.callbacks.remove(pauses)
                if freeze:
                    gc.unfreeze()
                nursery.cancel_scope.cancel()
    over = sum(steps.over.values())
    return Followed(
        seen - last_ack,
        lag,
        rss_before,
        steps.longest * 1e3,
        over,
        steps.longest_net * 1e3,
        pauses.longest * 1e3,
        heap_ms,
        heap_objects,
    )


async def burst(url: str, keys: int, *, freeze: bool = True) -> Row:
    def complete(observation: Observation) -> bool:
        try:
            return len(observation.snapshot().instances) == keys
        except EvidenceUnavailable:
            return False

    run = await _follow_writer(url, "burst", keys, 1, complete, freeze=freeze)
    stall = run.lag.longest * 1e3
    return Row(
        f"{keys:,}-distinct-key burst" + ("" if freeze else " (no gc.freeze)"),
        f"final state {max(run.after, 0.0):.2f} s after the last ack; longest stall "
        f"{stall:.1f} ms wall (lag p99 {nearest_rank(run.lag.samples, 0.99) * 1e3:.1f} ms), "
        f"longest task step {run.step_ms:.1f} ms CPU ({run.steps_over} over 25 ms; "
        f"{run.step_net_ms:.1f} ms net of GC; longest GC pause {run.gc_ms:.1f} ms wall); "
        f"RSS {run.rss_before:.0f} -> "
        f"peak {run.lag.peak_rss:.0f} MB; a full collection of the heap before the burst "
        f"({run.heap_objects:,} objects{', then frozen' if freeze else ''}) took "
        f"{run.heap_ms:.1f} ms",
        "final <= 5 s, stall <= 25 ms, memory bounded",
        run.after <= 5 and stall <= 25,
        {"final_s": run.after, "stall_ms": stall, "step_ms": run.step_ms},
    )


async def rewrites(url: str, keys: int, rounds: int) -> Row:
    def final(observation: Observation) -> bool:
        try:
            instances = observation.snapshot().instances
        except EvidenceUnavailable:
            return False
        return len(instances) == keys and all(i.port == rounds for i in instances)

    run = await _follow_writer(url, "rewrite", keys, rounds, final)
    return Row(
        f"{keys}-key burst rewritten {rounds} times",
        f"final state {max(run.after, 0.0) * 1e3:.0f} ms after the last ack; longest stall "
        f"{run.lag.longest * 1e3:.1f} ms wall, longest task step {run.step_ms:.1f} ms CPU",
        "final <= 150 ms",
        run.after <= 0.150,
        {"final_ms": run.after * 1e3, "stall_ms": run.lag.longest * 1e3},
    )


# ----------------------------------------------------------------------------- main

SCENARIOS = (
    "registrations",
    "raised",
    "watches",
    "watches-no-freeze",
    "watches-slow-poll",
    "watches-idle",
    "burst",
    "burst-no-freeze",
    "rewrites",
)


def run_scenario(url: str, name: str, sizes: Sizes) -> Row:
    if name == "registrations":
        idle = min(sizes.watch_seconds, 30.0)
        return trio.run(lambda: registrations(url, sizes.registrations, raised=False, idle=idle))
    if name == "raised":
        return trio.run(lambda: registrations(url, sizes.raised_registrations, raised=True))
    if name == "watches":
        return trio.run(watches, url, sizes.watches, sizes.watch_seconds)
    if name == "watches-no-freeze":
        return trio.run(partial(watches, url, sizes.watches, sizes.watch_seconds, freeze=False))
    if name == "watches-slow-poll":
        # The same with the owner's confirmation query every 20 s per service
        # (1,000 ranges per 20 s instead of per 5 s): what a host watching
        # that many services would configure.
        return trio.run(watches, url, sizes.watches, sizes.watch_seconds, 20_000)
    if name == "watches-idle":
        return trio.run(watches_idle, url, sizes.watches, min(sizes.watch_seconds, 30.0))
    if name == "burst":
        return trio.run(burst, url, sizes.burst)
    if name == "burst-no-freeze":
        # The same without gc.freeze(): every full collection also walks the
        # import-time heap (its cost is printed as the floor).
        return trio.run(partial(burst, url, sizes.burst, freeze=False))
    return trio.run(rewrites, url, sizes.rewrite_keys, sizes.rewrite_rounds)


def render(rows: Sequence[Row]) -> str:
    width = max(len(r.scenario) for r in rows)
    lines = [f"{'scenario':<{width}}  verdict  measured (target)", "-" * (width + 60)]
    for r in rows:
        verdict = "ok     " if r.ok else "MISSED "
        lines.append(f"{r.scenario:<{width}}  {verdict}  {r.measured}  ({r.target})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--only", choices=SCENARIOS, action="append", help="run only these")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("the etcd binary is not installed (apt-get install etcd-server)")
    rows = []
    # One server for the run; the scenarios use separate services (key
    # prefixes), and registrations run first (their lease count is exact).
    with tempfile.TemporaryDirectory(prefix="runtime-scale-") as root:
        server = EtcdProcess(binary, Path(root))
        try:
            for name in args.only or SCENARIOS:
                # Each scenario starts from a collected heap: the garbage of
                # the one before must not be collected inside its timings.
                gc.collect()
                rows.append(run_scenario(server.client, name, sizes))
                print(render(rows[-1:]), flush=True)
        finally:
            server.stop()
    print()
    print(f"runtime at scale against etcd on loopback ({'smoke' if args.smoke else 'full'} sizes)")
    print(render(rows))
    return rows


if __name__ == "__main__":
    main()
