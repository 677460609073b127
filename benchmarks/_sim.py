"""What the balancer simulations share: open-loop arrivals on trio's virtual
clock, the virtual-clock run, percentiles and the load average."""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence

import trio
import trio.testing

__all__ = ["load_average", "nearest_rank", "open_loop", "run_virtual"]


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The smallest value with at least ``q`` of the values at or below it."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


async def open_loop(
    rng: random.Random, rate: float, duration: float, start: Callable[[int], Awaitable[None]]
) -> int:
    """Poisson arrivals at ``rate`` per second from t=0 until ``duration``:
    arrival ``n`` runs ``start(n)`` as its own task. Returns the number of
    arrivals once all their tasks ended."""
    async with trio.open_nursery() as nursery:
        t = 0.0
        n = 0
        while True:
            t += rng.expovariate(rate)
            if t >= duration:
                break
            await trio.sleep_until(t)
            nursery.start_soon(start, n)
            n += 1
    return n


def run_virtual(main: Callable[[], Awaitable[None]]) -> float:
    """Run ``main`` under trio's autojumping virtual clock; the wall seconds it took."""
    wall = time.perf_counter()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return time.perf_counter() - wall


def load_average() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average n/a"
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min)"
