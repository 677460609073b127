"""Single flight under fan-out: many concurrent observers, one provider query.

``N`` tasks (10,000; 500 with ``--smoke``) wait at a gate, then all call
``handle.observe("orders", deadline)`` on one cold service at once. The
provider is an in-memory one whose single query answers ``latency`` (50 ms)
after every caller is parked in ``observe()`` (trio's
``wait_all_tasks_blocked``), so what is measured is the wake-up, not the
callers still queueing to get in. The promise checked: exactly one provider
query, and every caller resumes right after the listing arrives.

The table shows the *added wait*: for each caller, the time between the
provider returning its listing and that caller's ``observe()`` returning —
what the shared observation adds on top of the provider's own latency. Most
of it is waking and scheduling that many tasks, so the table also shows the
floor: the same number of trio tasks woken by one ``trio.Event``, each
inside its own ``trio.move_on_at`` deadline (a trio cancel scope: the
minimal thing the API must do, with no anyio layer in between), measured in
the same round, and the ratio of the two at p99 (target <= 1.5). Both sides
are spawned in a trio nursery and read trio's clock, so the harness charges
neither side for anything the other does not pay. Rounds
interleave the two; the median round by ratio is shown. "gate to last
return" is the whole fan-out, entering included. The p99 is also shown in
CPU time of this process (``time.process_time``), which what other
processes on a shared machine take away does not disturb.

Each side starts from a collected heap (``gc.collect()`` before its tasks
are spawned, outside the timed window; the collector stays on while it
runs). Left to chance, a full collection of the ten thousand tasks' heap
(tens of milliseconds) landed inside one side's wake-up in some rounds
and not in others, which made single rounds read anywhere from 0.6 to 2.4
on a quiet machine; from the same heap state both sides pay the
collections their own allocations cause, and no more.
Runs on trio with the real clock.

Run: ``python -m benchmarks.observe_fanout [--smoke] [--calls N] [--latency S]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass

import anyio
import trio
import trio.testing

from nadisc import ConnectionConfig, ConnectionSpec, Instance, OwnerBuilder, ProviderSnapshot
from nadisc.testing import MemoryProvider

FULL_CALLS = 10_000
SMOKE_CALLS = 500
LATENCY = 0.050


TARGET_RATIO = 1.5


@dataclass(frozen=True)
class Result:
    calls: int
    queries: int
    latency: float
    p50: float
    p99: float
    max: float
    total: float
    floor_p50: float
    floor_p99: float
    floor_max: float
    #: The same p99, in CPU time of this process (what other processes on
    #: the machine take away from the wall-clock figures is not in it).
    cpu_p99: float = 0.0
    floor_cpu_p99: float = 0.0

    @property
    def ratio(self) -> float:
        """Added wait over the floor, at p99."""
        return self.p99 / self.floor_p99 if self.floor_p99 > 0 else float("inf")

    @property
    def cpu_ratio(self) -> float:
        """Added wait over the floor, at p99, in CPU time."""
        return self.cpu_p99 / self.floor_cpu_p99 if self.floor_cpu_p99 > 0 else float("inf")


class _TimedProvider(MemoryProvider):
    """Answers once every caller is parked (``release``), and records when."""

    returned_at: float | None = None
    returned_cpu: float = 0.0
    release: trio.Event | None = None

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        if self.release is not None:
            await self.release.wait()
        snapshot = await super().query(service, deadline)
        self.returned_at = anyio.current_time()
        self.returned_cpu = time.process_time()
        return snapshot


def _quantile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


async def floor(calls: int) -> tuple[list[float], list[float]]:
    """Wake-up delays of ``calls`` trio tasks parked on one ``trio.Event``,
    each inside its own deadline (a trio cancel scope): the least the API
    must do (every caller waits with a deadline for one shared outcome),
    written as directly as trio allows, with no anyio layer in between."""
    event = trio.Event()
    woke: list[float] = []
    woke_cpu: list[float] = []
    clock = trio.current_time
    cpu = time.process_time

    async def waiter() -> None:
        with trio.move_on_at(clock() + 30):
            await event.wait()
        woke.append(clock())
        woke_cpu.append(cpu())

    gc.collect()  # from the same heap state as observe()'s side (module docstring)
    async with trio.open_nursery() as nursery:
        for _ in range(calls):
            nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        set_at = clock()
        set_cpu = cpu()
        event.set()
    return sorted(t - set_at for t in woke), sorted(t - set_cpu for t in woke_cpu)


async def run(calls: int, latency: float) -> Result:
    provider = _TimedProvider(services={"orders": "orders"}, latency=latency)
    provider.set("orders", [Instance(f"i{n}", f"10.0.0.{n + 1}", 8080) for n in range(8)])
    policy = ConnectionConfig(provider="memory")
    builder = OwnerBuilder().connection(ConnectionSpec("primary", provider, policy))
    finished: list[float] = []
    finished_cpu: list[float] = []
    cpu = time.process_time
    gate = anyio.Event()
    async with builder.open() as owner:
        await owner.prepare(anyio.current_time() + 5)
        handle = owner.client()

        clock = trio.current_time

        async def caller() -> None:
            await gate.wait()
            await handle.observe("orders", clock() + 30)
            finished.append(clock())
            finished_cpu.append(cpu())

        provider.release = trio.Event()
        gc.collect()  # from the same heap state as the floor's side (module docstring)
        started = anyio.current_time()
        # Spawned and timed as the floor's waiters are (a trio nursery, trio's
        # clock): only what observe() itself does differs between the two.
        async with trio.open_nursery() as nursery:
            for _ in range(calls):
                nursery.start_soon(caller)
            await anyio.sleep(0.05)  # every caller is parked at the gate
            started = anyio.current_time()
            gate.set()
            # Every caller entered observe() and waits for the first listing.
            await trio.testing.wait_all_tasks_blocked()
            provider.release.set()
        total = anyio.current_time() - started
    returned = provider.returned_at
    assert returned is not None
    added = sorted(max(0.0, t - returned) for t in finished)
    added_cpu = sorted(max(0.0, t - provider.returned_cpu) for t in finished_cpu)
    base, base_cpu = await floor(calls)
    return Result(
        calls=len(finished),
        queries=sum(provider.query_counts.values()),
        latency=latency,
        p50=statistics.median(added),
        p99=_quantile(added, 0.99),
        max=added[-1],
        total=total,
        floor_p50=statistics.median(base),
        floor_p99=_quantile(base, 0.99),
        floor_max=base[-1],
        cpu_p99=_quantile(added_cpu, 0.99),
        floor_cpu_p99=_quantile(base_cpu, 0.99),
    )


def render(result: Result) -> str:
    ms = 1000.0
    rows = [
        ("observe() calls", f"{result.calls}", ""),
        ("provider queries", f"{result.queries}", ""),
        ("provider latency", f"{result.latency * ms:.1f} ms", ""),
        ("added wait p50", f"{result.p50 * ms:.2f} ms", f"{result.floor_p50 * ms:.2f} ms"),
        ("added wait p99", f"{result.p99 * ms:.2f} ms", f"{result.floor_p99 * ms:.2f} ms"),
        ("added wait max", f"{result.max * ms:.2f} ms", f"{result.floor_max * ms:.2f} ms"),
        ("gate to last return", f"{result.total * ms:.1f} ms", ""),
        ("p99 ratio to the floor", f"{result.ratio:.2f}", f"<= {TARGET_RATIO}"),
        (
            "added wait p99, CPU time",
            f"{result.cpu_p99 * ms:.2f} ms",
            f"{result.floor_cpu_p99 * ms:.2f} ms",
        ),
        ("p99 ratio, CPU time", f"{result.cpu_ratio:.2f}", ""),
    ]
    width = max(len(name) for name, _, _ in rows)
    header = f"{'':<{width}}  {'observe()':>12}  {'floor':>12}"
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = [f"observe fan-out on one cold service (trio, real clock); load average {load}", header]
    lines.append("-" * len(header))
    lines += [f"{name:<{width}}  {value:>12}  {base:>12}" for name, value, base in rows]
    return "\n".join(lines)


def median_result(results: list[Result]) -> Result:
    """The round whose p99 ratio is the median (rounds interleave the
    observe() fan-out and its floor, so both see the same load)."""
    ordered = sorted(results, key=lambda r: r.ratio)
    return ordered[len(ordered) // 2]


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_CALLS} calls")
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--latency", type=float, default=LATENCY, help="seconds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    args = parser.parse_args(argv)
    calls = args.calls or (SMOKE_CALLS if args.smoke else FULL_CALLS)
    rounds = args.rounds or (1 if args.smoke else 5)
    results = [trio.run(run, calls, args.latency) for _ in range(rounds)]
    result = median_result(results)
    print(render(result))
    if rounds > 1:
        ratios = ", ".join(f"{r.ratio:.2f}" for r in results)
        print(f"p99 ratio per round ({rounds} rounds, median shown above): {ratios}")
        cpu = sorted(r.cpu_ratio for r in results)
        print(
            "p99 ratio in CPU time per round: "
            + ", ".join(f"{r.cpu_ratio:.2f}" for r in results)
            + f" (median {cpu[len(cpu) // 2]:.2f})"
        )
    return result


if __name__ == "__main__":
    main()
