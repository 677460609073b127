"""Load-aware selection through the balance, on trio's virtual clock."""

from __future__ import annotations

import random

import pytest
import trio

from poise import Balance, Endpoint, PeakEwma, PowerOfTwoChoices, service_fn


def _backend(name: str, latency: list[float]):
    async def serve(request: int) -> str:
        await trio.sleep(latency[0])
        return name

    return serve


@pytest.mark.trio_only
async def test_p2c_on_peak_ewma_steers_away_from_a_degraded_endpoint(autojump_clock) -> None:
    latencies = {"fast": [0.010], "slow": [0.010], "other": [0.010]}
    eps = [
        Endpoint(name, service_fn(_backend(name, lat)), tracker=PeakEwma(decay=1.0))
        for name, lat in latencies.items()
    ]
    balance: Balance[int, str] = Balance(PowerOfTwoChoices(random.Random(7)), eps)
    counts = {name: 0 for name in latencies}

    async def worker(n: int) -> None:
        for i in range(n):
            counts[await balance.dispatch(i)] += 1

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(worker, 50)
    healthy = dict(counts)
    assert min(healthy.values()) > 60  # equal latency: shared evenly-ish

    latencies["slow"][0] = 0.200
    counts = {name: 0 for name in latencies}
    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(worker, 50)
    assert counts["slow"] < 0.1 * sum(counts.values()), counts
    for ep in eps:
        assert ep.tracker.load(trio.current_time()) > 0
        assert isinstance(ep.tracker, PeakEwma) and ep.tracker.in_flight == 0
    assert balance.statistics().in_flight == 0
