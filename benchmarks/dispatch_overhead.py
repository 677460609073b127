"""What the balance costs per call, next to the least a hand-written loop must do.

Each variant dispatches to 100, and then 10,000, endpoints whose service is a
no-op that is always ready, choosing by power of two choices on a peak-EWMA
load:

``Balance.dispatch``
    ``poise.Balance(PowerOfTwoChoices(), endpoints)`` where every endpoint
    has a ``PeakEwma`` tracker: readiness scan, selection, load guard, call,
    completion.
``Balance.dispatch_held`` (for information; no target)
    the same dispatch returning a ``Held`` whose guard is ended at once
    with ``complete()``: what a response held open costs on top.
``trio-native hand loop`` (the baseline)
    the same decision written inline with no abstraction: two random
    samples, compare ``rtt_estimate x (pending + 1)``, count the call, await
    the no-op, fold the round-trip time into the EWMA, reading
    ``trio.current_time()`` and awaiting one ``trio.lowlevel.checkpoint()``
    per call, as ``Balance.dispatch`` must (an async function that may block
    always checkpoints). Its state is three flat lists (estimate, last
    update, calls pending) and it does not even fade the estimates it
    compares. This is the least a trio program can do.
``anyio-native hand loop`` (for information)
    the same loop through ``anyio.current_time()`` and
    ``anyio.lowlevel.checkpoint()``, which look the backend up on every call.

All run in the same trio run, interleaved in rounds (every variant at every
size once per round, in a shuffled order), timed in CPU time
(``time.process_time``: the least disturbed by other processes on the
machine). The table shows each variant's median CPU time per call and the
median of its per-round ratios to the hand loop of the same round and size
(a round compares variants that ran within a second of each other), with
the load average before and after. The targets: ``Balance.dispatch`` at
most 1.2x the trio-native loop at 100 endpoints and 1.3x at 10,000.

What the hand loop leaves out (it is the floor, not the same job):
it compares bare estimates (no fade, so no ``exp`` per sample), has no age
floor, no failure penalty, no count of observations or of the balance's
calls in flight, no readiness, and no error or cancellation handling; and
it runs inline in the benchmark's loop, where ``Balance.dispatch`` is an
``async def`` method the caller awaits, one more coroutine per call.

Run: ``python -m benchmarks.dispatch_overhead [--smoke] [--ops N] [--rounds R]``
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import trio
import trio.lowlevel

from poise import Balance, Endpoint, PeakEwma, PowerOfTwoChoices, service_fn

#: Pool sizes, each with the most Balance.dispatch may cost against the hand loop.
TARGETS = {100: 1.2, 10_000: 1.3}


async def _noop(request: int) -> int:
    return request


def _balance(n: int, seed: int) -> Balance[int, int]:
    endpoints = [Endpoint(f"ep-{i}", service_fn(_noop), tracker=PeakEwma()) for i in range(n)]
    return Balance(PowerOfTwoChoices(random.Random(seed)), endpoints)


async def run_balance(n: int, ops: int, seed: int) -> float:
    """Seconds for ``ops`` dispatches through a Balance of ``n`` endpoints."""
    balance = _balance(n, seed)
    dispatch = balance.dispatch
    start = time.process_time()
    for i in range(ops):
        await dispatch(i)
    return time.process_time() - start


async def run_held(n: int, ops: int, seed: int) -> float:
    """Seconds for ``ops`` ``dispatch_held`` calls, each ended at once with ``complete()``."""
    dispatch_held = _balance(n, seed).dispatch_held
    start = time.process_time()
    for i in range(ops):
        (await dispatch_held(i)).complete()
    return time.process_time() - start


async def run_hand_loop(n: int, ops: int, seed: int) -> float:
    """Seconds for ``ops`` calls through a minimal inline P2C + peak EWMA (trio-native)."""
    return await _hand_loop(n, ops, seed, trio.current_time, trio.lowlevel.checkpoint)


async def run_anyio_loop(n: int, ops: int, seed: int) -> float:
    """The same loop through anyio's clock and checkpoint."""
    return await _hand_loop(n, ops, seed, anyio.current_time, anyio.lowlevel.checkpoint)


async def _hand_loop(
    n: int,
    ops: int,
    seed: int,
    clock: Callable[[], float],
    checkpoint: Callable[[], Awaitable[None]],
) -> float:
    decay = 10.0
    estimate = [0.030] * n
    updated = [0.0] * n
    pending = [0] * n
    draw = random.Random(seed).random
    exp = math.exp
    call = _noop
    start = time.process_time()
    for i in range(ops):
        await checkpoint()
        now = clock()
        a = int(draw() * n)
        b = int(draw() * (n - 1))
        if b >= a:
            b += 1
        pick = b if estimate[b] * (pending[b] + 1) < estimate[a] * (pending[a] + 1) else a
        pending[pick] += 1
        await call(i)
        end = clock()
        pending[pick] -= 1
        rtt = end - now
        if rtt > estimate[pick]:
            estimate[pick] = rtt
        else:
            w = exp(-(end - updated[pick]) / decay)
            estimate[pick] = estimate[pick] * w + rtt * (1.0 - w)
        updated[pick] = end
    return time.process_time() - start


VARIANTS = {
    "balance": run_balance,
    "hand": run_hand_loop,
    "anyio": run_anyio_loop,
    "held": run_held,
}


@dataclass(frozen=True)
class Result:
    ops: int
    #: (variant, endpoints) -> median CPU ns per op over the rounds
    ns: dict[tuple[str, int], float]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    #: (variant, endpoints) -> median over the rounds of the round's ratio to the hand loop
    ratios: dict[tuple[str, int], float]
    rounds: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted({n for _, n in self.ns}))

    def ratio(self, n: int, variant: str = "balance") -> float:
        return self.ratios[(variant, n)]

    @property
    def balance_ns(self) -> float:
        return self.ns[("balance", self.sizes[0])]

    @property
    def hand_ns(self) -> float:
        return self.ns[("hand", self.sizes[0])]

    @property
    def anyio_ns(self) -> float:
        return self.ns[("anyio", self.sizes[0])]

    @property
    def ratio_small(self) -> float:
        """Balance.dispatch against the hand loop at the smallest size."""
        return self.ratio(self.sizes[0])


async def measure(ops: int, rounds: int, sizes: tuple[int, ...] = tuple(TARGETS)) -> Result:
    """Every variant at every size once per round, in a shuffled order; medians.

    A variant's ratio is the median over the rounds of its time divided by
    the hand loop's time at the same size in the same round.
    """
    before = os.getloadavg()
    # A short warm-up of each, then interleaved rounds.
    for n in sizes:
        for run in VARIANTS.values():
            await run(n, min(ops, 2000), 0)
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in VARIANTS for n in sizes}
    ratios: dict[tuple[str, int], list[float]] = {key: [] for key in times}
    order = list(times)
    shuffle = random.Random(0).shuffle
    for r in range(rounds):
        shuffle(order)
        got = {key: await VARIANTS[key[0]](key[1], ops, r) for key in order}
        for (name, n), seconds in got.items():
            times[(name, n)].append(seconds)
            ratios[(name, n)].append(seconds / got[("hand", n)])
    return Result(
        ops=ops,
        ns={key: statistics.median(seconds) / ops * 1e9 for key, seconds in times.items()},
        load_before=before,
        load_after=os.getloadavg(),
        ratios={key: statistics.median(values) for key, values in ratios.items()},
        rounds=rounds,
    )


ROWS = (
    ("balance", "Balance.dispatch (P2C + PeakEwma)"),
    ("hand", "trio-native hand loop (P2C + EWMA, 1 checkpoint)"),
    ("anyio", "anyio-native hand loop (same, anyio clock + checkpoint)"),
    ("held", "Balance.dispatch_held + complete()"),
)


def format_table(result: Result) -> str:
    sizes = result.sizes
    header = ("variant", *(f"{n:,} ep. ns/op  ratio" for n in sizes))
    # ns/op: the median round; ratio: the median of the per-round ratios.
    rows: list[tuple[str, ...]] = [header]
    for name, label in ROWS:
        rows.append(
            (
                label,
                *(f"{result.ns[(name, n)]:,.0f}  {result.ratio(n, name):.2f}" for n in sizes),
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        cells = [f"{row[0]:<{widths[0]}}"]
        cells += [f"{cell:>{w}}" for cell, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    targets = ", ".join(
        f"{n:,} ep. {result.ratio(n):.2f} (target <= {TARGETS[n]})" for n in sizes if n in TARGETS
    )
    lines.append(
        f"always-ready endpoints, {result.ops:,} ops per round, {result.rounds} rounds, "
        f"CPU time; ns/op = median round, ratio = median of per-round ratios; "
        f"Balance.dispatch / trio hand loop: {targets}"
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
    parser.add_argument("--smoke", action="store_true", help="a few thousand ops, one round")
    parser.add_argument("--ops", type=int, default=100_000, help="dispatches per round")
    parser.add_argument("--rounds", type=int, default=9, help="rounds per variant")
    args = parser.parse_args(argv)
    ops, rounds = (3000, 2) if args.smoke else (args.ops, args.rounds)
    sizes = (100, 1000) if args.smoke else tuple(TARGETS)
    result: Result = anyio.run(measure, ops, rounds, sizes, backend="trio")
    print(format_table(result))
    return result


if __name__ == "__main__":
    main()
