"""What one dispatch costs as the pool grows, when most of it cannot be picked.

Every endpoint is a ``ConcurrencyLimit(service_fn(no-op), 1)`` with a
``PeakEwma`` tracker, balanced by ``PowerOfTwoChoices``; one trio task calls
``Balance.dispatch`` in a loop. Three shapes of pool, at 10, 100, 1,000 and
10,000 endpoints:

``all ready``
    every endpoint is free.
``99.9% drained``
    all but ``max(1, n // 1000)`` endpoints have ``eligible = False``: they
    must cost nothing, since they cannot be picked.
``50% busy``
    half the endpoints hold their only permit elsewhere (a reservation taken
    before they join and never given back), so their ``poll_ready`` says
    "not yet" and they never call ``wake``: after one poll they are parked,
    and only the re-check every ``pending_recheck`` seconds (1 s) polls them
    again.

Cost is CPU time per dispatch (``time.process_time``, so other processes on
the machine disturb it less). Every pool is built first and all are measured
in interleaved rounds; a pool's figure is its median round, and every ratio
is the median over the rounds of that round's ratio, so the base and the
rows compared with it see the same machine. The load average is printed
before and after. The target: the drained and busy rows cost at most 1.5x
the 10-endpoint all-ready row, whatever the size.

A busy pool of n endpoints still has n/2 ready ones, and sampling two at
random from a large ready set costs memory traffic by itself (the all-ready
row grows the same way; the 99.9%-drained row, with n/1000 ready, does not).
So the table also prints each busy pool against an all-ready pool of n/2
endpoints measured in the same rounds: that ratio is what the busy half
costs, the thing the scan must keep flat.

Run: ``python -m benchmarks.dispatch_scale [--smoke] [--ops N] [--rounds R]``
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass

import trio

from poise import Balance, ConcurrencyLimit, Endpoint, PeakEwma, PowerOfTwoChoices, service_fn

SIZES = (10, 100, 1_000, 10_000)
SHAPES = ("all ready", "99.9% drained", "50% busy")
#: The reference row of the busy pools: all ready, n/2 endpoints.
MATCHED = "all ready, n/2 ep."
TARGET_RATIO = 1.5


async def _noop(request: int) -> int:
    return request


def _never() -> None:
    """The wake of the reservation held elsewhere: nobody listens."""


def build(n: int, shape: str, seed: int) -> Balance[int, int]:
    endpoints: list[Endpoint[int, int]] = []
    usable = max(1, n // 1000)
    for i in range(n):
        service: ConcurrencyLimit[int, int] = ConcurrencyLimit(service_fn(_noop), 1)
        eligible = True
        if shape == "99.9% drained" and i >= usable:
            eligible = False
        elif shape == "50% busy" and i % 2 == 1:
            assert service.poll_ready(_never)  # the permit is taken elsewhere
        endpoints.append(Endpoint(i, service, tracker=PeakEwma(), eligible=eligible))
    return Balance(PowerOfTwoChoices(random.Random(seed)), endpoints)


async def _warm(balance: Balance[int, int], ops: int) -> None:
    """The first scan parks the busy half; a few hundred dispatches settle it."""
    for i in range(min(ops, 1000)):
        await balance.dispatch(i)


async def _round(balance: Balance[int, int], ops: int) -> float:
    """CPU seconds for ``ops`` dispatches."""
    dispatch = balance.dispatch
    start = time.process_time()
    for i in range(ops):
        await dispatch(i)
    return time.process_time() - start


@dataclass(frozen=True)
class Result:
    ops: int
    sizes: tuple[int, ...]
    #: (shape, endpoints) -> median CPU ns per dispatch over the rounds
    ns: dict[tuple[str, int], float]
    #: (shape, endpoints) -> median per-round ratio to the base
    to_base: dict[tuple[str, int], float]
    #: endpoints -> median per-round ratio of 50% busy to all ready at n/2
    to_matched: dict[int, float]
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def base(self) -> float:
        return self.ns[("all ready", self.sizes[0])]

    def ratio(self, shape: str, n: int) -> float:
        return self.to_base[(shape, n)]

    @property
    def worst_ratio(self) -> float:
        return max(self.ratio(s, n) for s in SHAPES[1:] for n in self.sizes)

    def busy_to_matched(self, n: int) -> float:
        """50% busy at n against all ready at n/2: the cost of the busy half alone."""
        return self.to_matched[n]


async def measure(ops: int, rounds: int, sizes: tuple[int, ...]) -> Result:
    """Every pool is built first, then measured in interleaved rounds.

    Each round runs every (shape, size) once, in a shuffled order; a
    pool's figure is its median round and a ratio the median of the
    per-round ratios: the base and the rows it is compared with see the
    same machine, which on a shared or virtual machine varies by as much as
    2x from one second to the next.
    """
    before = os.getloadavg()
    pools = {(shape, n): build(n, shape, seed=n) for shape in SHAPES for n in sizes}
    # All-ready pools with as many ready endpoints as the busy ones have:
    # what sampling a ready set of that size costs by itself.
    for n in sizes:
        pools[(MATCHED, n)] = build(n // 2, "all ready", seed=n + 1)
    for balance in pools.values():
        await _warm(balance, ops)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in pools}
    to_base: dict[tuple[str, int], list[float]] = {key: [] for key in pools}
    to_matched: dict[int, list[float]] = {n: [] for n in sizes}
    order = list(pools)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        got = {key: await _round(pools[key], ops) for key in order}
        base = got[("all ready", sizes[0])]
        for key, seconds in got.items():
            times[key].append(seconds)
            to_base[key].append(seconds / base)
        for n in sizes:
            to_matched[n].append(got[("50% busy", n)] / got[(MATCHED, n)])
    for balance in pools.values():
        assert balance.statistics().in_flight == 0
    median = statistics.median
    return Result(
        ops=ops,
        sizes=sizes,
        ns={key: median(seconds) / ops * 1e9 for key, seconds in times.items()},
        to_base={key: median(values) for key, values in to_base.items()},
        to_matched={n: median(values) for n, values in to_matched.items()},
        load_before=before,
        load_after=os.getloadavg(),
    )


def format_table(result: Result, sizes: tuple[int, ...]) -> str:
    header = ("pool", *(f"{n:,} ep." for n in sizes), "worst / base")
    rows: list[tuple[str, ...]] = [header]
    for shape in SHAPES:
        cells = [f"{result.ns[(shape, n)]:,.0f}" for n in sizes]
        worst = max(result.ratio(shape, n) for n in sizes)
        rows.append((shape, *cells, f"{worst:.2f}"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        cells = [f"{row[0]:<{widths[0]}}"]
        cells += [f"{cell:>{w}}" for cell, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(
        "50% busy / all ready with as many ready endpoints (n/2): "
        + ", ".join(f"{n:,} ep. {result.busy_to_matched(n):.2f}" for n in sizes)
    )
    lines.append(
        f"CPU ns per Balance.dispatch (P2C + PeakEwma, ConcurrencyLimit(1) services), "
        f"{result.ops:,} dispatches per round, median round; ratios: median of per-round "
        f"ratios; base = all ready at {sizes[0]} endpoints ({result.base:,.0f} ns); "
        f"target: drained and busy rows <= {TARGET_RATIO} x base"
    )
    lines.append(
        "load average before "
        + " ".join(f"{x:.2f}" for x in result.load_before)
        + ", after "
        + " ".join(f"{x:.2f}" for x in result.load_after)
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="small pools, few dispatches")
    parser.add_argument("--ops", type=int, default=10_000, help="dispatches per round")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds")
    args = parser.parse_args(argv)
    sizes: tuple[int, ...]
    if args.smoke:
        ops, rounds, sizes = 2_000, 2, SIZES[:3]
    else:
        ops, rounds, sizes = args.ops, args.rounds, SIZES
    result: Result = trio.run(measure, ops, rounds, sizes)
    print(format_table(result, sizes))
    return result


if __name__ == "__main__":
    main()
