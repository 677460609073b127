"""What a round-robin dispatch costs as a stable pool grows.

``RoundRobin`` is the discovery transport's default policy (``lb_strategy:
round_robin``). Its rule (the least recently picked ready endpoint) takes a
scan of the ready endpoints when the ready set changes between picks; over
a stable set of always-ready endpoints (the transport's instances, any
``service_fn``) it is plain rotation and now costs O(1) Python work per
pick. Pools of 3, 100, 1,000 and 10,000 always-ready endpoints
(``service_fn`` of a no-op, the default ``InFlight`` tracker); one trio
task dispatches in a loop. Rows, CPU time per dispatch
(``time.process_time``), all pools measured in interleaved rounds, medians;
each cell's ratio is to the same row at 3 endpoints in the same round (how
the cost grows with the pool):

``Balance.dispatch``
    ``Balance(RoundRobin(), endpoints).dispatch(request)``.
``hand loop``
    A trio-native rotation over the same no-op functions: a cursor modulo
    ``n`` and ``await function(request)``; no readiness, no load tracking,
    no checkpoint. The floor of any round robin (for information).
``policy pick``
    ``RoundRobin.pick`` alone on the balance's list (for information).

Run: ``python -m benchmarks.round_robin_scale [--smoke] [--ops N] [--rounds R]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence

import trio

from poise import Balance, Endpoint, RoundRobin, service_fn

SIZES = (3, 100, 1_000, 10_000)
SMOKE_SIZES = (3, 100, 1_000)
ROWS = ("Balance.dispatch", "hand loop", "policy pick")


async def _noop(request: int) -> int:
    return request


def build(n: int) -> Balance[int, int]:
    return Balance(RoundRobin(), [Endpoint(i, service_fn(_noop)) for i in range(n)])


async def _dispatch(balance: Balance[int, int], ops: int) -> float:
    dispatch = balance.dispatch
    start = time.process_time()
    for i in range(ops):
        await dispatch(i)
    return time.process_time() - start


async def _hand(functions: Sequence[Callable[[int], Awaitable[int]]], ops: int) -> float:
    n = len(functions)
    cursor = 0
    start = time.process_time()
    for i in range(ops):
        cursor = cursor + 1 if cursor + 1 < n else 0
        await functions[cursor](i)
    return time.process_time() - start


async def _pick(balance: Balance[int, int], ops: int) -> float:
    policy = balance.policy
    assert isinstance(policy, RoundRobin)
    ready = balance._ready
    pick = policy.pick
    start = time.process_time()
    for _ in range(ops):
        pick(ready, None, 0.0)
    return time.process_time() - start


async def measure(
    ops: int, rounds: int, sizes: tuple[int, ...]
) -> dict[tuple[str, int], tuple[float, float]]:
    """(row, size) -> (median ns per operation, median per-round ratio to the smallest pool)."""
    balances = {n: build(n) for n in sizes}
    functions = {n: [_noop] * n for n in sizes}
    for balance in balances.values():
        assert balance.ready_nowait()
        for i in range(2 * len(balance)):
            await balance.dispatch(i)
    seconds: dict[tuple[str, int], list[float]] = {(row, n): [] for row in ROWS for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            seconds[("Balance.dispatch", n)].append(await _dispatch(balances[n], ops))
            seconds[("hand loop", n)].append(await _hand(functions[n], ops))
            seconds[("policy pick", n)].append(await _pick(balances[n], ops))
    for balance in balances.values():
        assert balance.statistics().in_flight == 0
    out = {}
    for (row, n), times in seconds.items():
        smallest = seconds[(row, sizes[0])]
        ratios = [mine / base for mine, base in zip(times, smallest, strict=True)]
        out[(row, n)] = (statistics.median(times) / ops * 1e9, statistics.median(ratios))
    return out


def main(argv: list[str] | None = None) -> dict[tuple[str, int], tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="small sizes, few operations")
    parser.add_argument("--ops", type=int, default=20_000, help="dispatches per pool and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    sizes, ops, rounds = (SMOKE_SIZES, 2_000, 1) if args.smoke else (SIZES, args.ops, args.rounds)
    result = trio.run(measure, ops, rounds, sizes)
    print(f"{'row (ns per op, / smallest)':<30}" + "".join(f"{f'{n:,} ep.':>20}" for n in sizes))
    for row in ROWS:
        cells = "".join(
            f"{f'{result[(row, n)][0]:,.0f} ({result[(row, n)][1]:.2f}x)':>20}" for n in sizes
        )
        print(f"{row:<30}{cells}")
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"{ops:,} operations per pool and round, {rounds} round(s), medians; load {load}")
    return result


if __name__ == "__main__":
    main()
